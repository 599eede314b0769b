"""Pure functions from a `Snapshot` to the series, table and text the dashboard shows."""

from __future__ import annotations

import re
import time
from typing import Any

from .data import FileRow, Snapshot
from .records import SyncRecord
from .replicas import ReplicaStatus

__all__ = [
    "REPLICA_COLUMNS",
    "TABLE_COLUMNS",
    "files_table",
    "health_markdown",
    "latency_series",
    "plain",
    "replicas_table",
    "reward_series",
    "series_json",
    "status_markdown",
    "timing_series",
    "version_series",
]

TABLE_COLUMNS = ["version", "kind", "encoding", "size", "sparsity", "changed", "status"]
_ASCII_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def plain(text: object) -> str:
    """`text` from a bucket or a replica, shown in Markdown as itself on one line.

    A bucket writer controls these strings, and Gradio's sanitiser keeps images and links: every
    ASCII punctuation character is backslash-escaped (CommonMark shows it literally), so no
    image, link, autolink, HTML tag or code span can start, and no backtick can close ours.
    """
    return _ASCII_PUNCTUATION.sub(r"\\\1", " ".join(str(text).split()))


def version_series(snap: Snapshot) -> list[dict[str, Any]]:
    """One row per version: sparsity, changed elements and payload bytes.

    Headers of files still in the bucket are the authority; metrics records fill in versions
    whose files retention has deleted (and timings, which only metrics carry).
    """
    rows: dict[int, dict[str, Any]] = {}
    for rec in snap.records:
        rows[rec.version] = _from_record(rec)
    for file in snap.files:
        row = rows.setdefault(file.entry.version, _empty_row(file.entry.version))
        _merge_file(row, file)
    for row in rows.values():
        row["kind"] = "+".join(k for k in ("delta", "anchor") if row[f"{k}_bytes"] is not None)
    return [rows[v] for v in sorted(rows)]


def timing_series(snap: Snapshot) -> tuple[list[dict[str, Any]], bool]:
    """(rows of version/series/seconds, whether any replica reported).

    Each replica that synced contributes its stage, pause and total seconds (the records'
    `replicas`); without any, the trainer's encode and upload seconds stand in.
    """
    rows: list[dict[str, Any]] = []
    for rec in snap.records:
        for rep in rec.replicas:
            if rep.ok:
                rows.extend(
                    {"version": rec.version, "series": f"{rep.name} {name}", "seconds": s}
                    for name, s in (
                        ("stage", rep.stage_s),
                        ("pause", rep.pause_s),
                        ("total", rep.total_s),
                    )
                )
    if rows:
        return rows, True
    for rec in snap.records:
        for name, s in (("trainer encode", rec.encode_s), ("trainer upload", rec.upload_s)):
            rows.append({"version": rec.version, "series": name, "seconds": s})
    return rows, False


def latency_series(snap: Snapshot) -> list[dict[str, Any]]:
    """Commit-to-serving latency per version, one series per replica (the records' `replicas`
    `latency_s`); a follower's is named so: it is measured to within the trainer's poll."""
    return [
        {
            "version": rec.version,
            "series": f"{rep.name} (following)" if rep.following else rep.name,
            "seconds": rep.latency_s,
        }
        for rec in snap.records
        for rep in rec.replicas
        if rep.latency_s is not None
    ]


def reward_series(snap: Snapshot) -> list[dict[str, Any]]:
    """The reward TRL logged at the step that produced each version, where one was logged."""
    return [
        {"step": rec.step, "version": rec.version, "reward": rec.reward_mean}
        for rec in snap.records
        if rec.reward_mean is not None and rec.step is not None
    ]


def files_table(snap: Snapshot, limit: int = 20) -> list[list[Any]]:
    """The newest `limit` files the manifest names, trouble marked in the status column."""
    table = []
    for file in snap.files[:limit]:
        e, h = file.entry, file.header
        sparsity = f"{h.sparsity:.2%}" if h is not None and e.kind == "delta" else ""
        changed = h.changed_elements if h is not None else e.changed_elements
        status = "ok" if file.status == "ok" else f"⚠ {file.detail}"
        table.append(
            [e.version, e.kind, e.encoding, human_bytes(e.bytes), sparsity, changed, status]
        )
    return table


def health_markdown(snap: Snapshot) -> str:
    h = snap.health
    if h is None:
        return "**Chain:** nothing committed yet."
    age = max(0.0, time.time() - h.updated_at)
    return (
        f"**Run** {plain(h.run_id)} · **latest version** {h.latest_version} · "
        f"**latest anchor** {h.latest_anchor} · **replay cost for a new replica** "
        f"{human_bytes(h.replay_bytes)} (anchor {h.latest_anchor} + "
        f"{h.replay_files - 1} deltas) · **anchor size** {human_bytes(h.model_bytes)} · "
        f"{h.anchors} anchors and {h.deltas} deltas retained · last commit {age:.0f} s ago"
    )


def status_markdown(snap: Snapshot) -> str:
    label = {"ok": "OK", "empty": "EMPTY", "waiting": "WAITING", "error": "ERROR"}[snap.state]
    shown = time.strftime("%H:%M:%S", time.localtime(snap.polled_at))
    lines = [f"**{label}** {plain(snap.bucket)}: {plain(snap.message)} (read at {shown})"]
    lines += [f"- ⚠ {plain(p)}" for p in snap.problems[:10]]
    if len(snap.problems) > 10:
        lines.append(f"- … and {len(snap.problems) - 10} more")
    return "\n".join(lines)


REPLICA_COLUMNS = ["replica", "state", "version", "lag", "last pause", "detail"]


def replicas_table(statuses: list[ReplicaStatus]) -> list[list[Any]]:
    """One row per replica the dashboard watches: what its open /health said last."""
    return [
        [
            s.url,
            s.state,
            "" if s.version is None else s.version,
            "" if s.lag is None else s.lag,
            "" if s.last_pause_s is None else f"{s.last_pause_s * 1e3:.0f} ms",
            s.detail,
        ]
        for s in statuses
    ]


def series_json(snap: Snapshot) -> dict[str, Any]:
    """Everything the charts show, as plain JSON (the `/series` API endpoint)."""
    timings, from_replicas = timing_series(snap)
    h = snap.health
    return {
        "bucket": snap.bucket,
        "state": snap.state,
        "message": snap.message,
        "problems": list(snap.problems),
        "versions": version_series(snap),
        "timings": timings,
        "timings_from_replicas": from_replicas,
        "reward": reward_series(snap),
        "latency": latency_series(snap),
        "files": [_file_json(f) for f in snap.files],
        "health": None if h is None else dict(h.__dict__),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _empty_row(version: int) -> dict[str, Any]:
    return {
        "version": version,
        "kind": "",
        "sparsity": None,
        "changed_elements": None,
        "total_elements": None,
        "delta_bytes": None,
        "anchor_bytes": None,
        "full_bytes": None,
        "source": "header",
    }


def _from_record(rec: SyncRecord) -> dict[str, Any]:
    row = _empty_row(rec.version)
    row["source"] = "metrics"
    if rec.has_delta:
        row["sparsity"] = rec.sparsity
        row["changed_elements"] = rec.changed_elements
        row["delta_bytes"] = rec.delta_bytes
    if rec.has_anchor:
        row["anchor_bytes"] = rec.anchor_bytes
    row["total_elements"] = rec.total_elements or None
    row["full_bytes"] = rec.full_bytes or None
    return row


def _merge_file(row: dict[str, Any], file: FileRow) -> None:
    entry, header = file.entry, file.header
    row[f"{entry.kind}_bytes"] = entry.bytes
    if header is None:
        return
    if row["source"] == "metrics":
        row["source"] = "both"
    row["total_elements"] = header.total_elements
    row["full_bytes"] = row["full_bytes"] or 2 * header.total_elements  # bf16
    if entry.kind == "delta":
        row["sparsity"] = header.sparsity
        row["changed_elements"] = header.changed_elements


def _file_json(file: FileRow) -> dict[str, Any]:
    e, h = file.entry, file.header
    return {
        "version": e.version,
        "kind": e.kind,
        "encoding": e.encoding,
        "name": e.label,  # not "path": Gradio clients take {"path": ...} for a file to download
        "bytes": e.bytes,
        "sparsity": h.sparsity if h is not None and e.kind == "delta" else None,
        "changed_elements": h.changed_elements if h is not None else None,
        "status": file.status,
        "detail": file.detail,
    }
