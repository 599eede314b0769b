"""Reads a bucket incrementally: the manifest each poll, headers and metrics only when new.

Files are immutable (only the manifest moves), so a header or metrics record read once is cached
by path forever; a poll reads the manifest, lists the run's metrics folder and fetches only what
it has not seen. Every loop is bounded by a count and by a time budget; what does not fit is read
on the next poll.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from deltasync.errors import DeltaSyncError, FormatError, StoreError
from deltasync.store import MissingFile, RefusedObject, Store
from deltasync.wire.manifest import ChainEntry, Manifest, read_manifest_bytes
from deltasync.wire.metrics import MAX_RECORD_BYTES

from .records import HeaderInfo, SyncRecord, read_header

__all__ = ["BucketWatcher", "FileRow", "Health", "Snapshot", "WatcherConfig"]

_METRICS_NAME = re.compile(r"(\d{8,})\.json")
State = Literal["ok", "empty", "waiting", "error"]


@dataclass(frozen=True)
class WatcherConfig:
    """Bounds on one poll.

    Attributes:
        max_versions: metrics records kept (the newest ones); charts show this many versions.
        max_reads: headers plus metrics records fetched in one poll; the rest wait for the next.
        budget_s: a poll stops fetching new files after this many seconds.
        min_poll_s: callers within this many seconds of the last poll share its result.
    """

    max_versions: int = 500
    max_reads: int = 200
    budget_s: float = 20.0
    min_poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_versions < 1 or self.max_reads < 1:
            raise ValueError(f"max_versions and max_reads must be >= 1: {self}")
        if not self.budget_s > 0 or self.min_poll_s < 0:
            raise ValueError(f"budget_s must be > 0 and min_poll_s >= 0: {self}")


@dataclass(frozen=True)
class FileRow:
    """A file the manifest names, with what its header says; `status` marks trouble."""

    entry: ChainEntry
    status: Literal["ok", "pending", "corrupt", "unreadable"]
    detail: str = ""
    header: HeaderInfo | None = None


@dataclass(frozen=True)
class Health:
    """The chain as a new replica sees it."""

    run_id: str
    latest_version: int
    latest_anchor: int
    replay_bytes: int  # latest anchor + every delta after it: a cold start's download
    replay_files: int
    model_bytes: int
    anchors: int
    deltas: int
    updated_at: float


@dataclass(frozen=True)
class Snapshot:
    """Everything one poll found; immutable, shared by every browser session."""

    bucket: str
    state: State
    message: str
    polled_at: float
    health: Health | None = None
    files: tuple[FileRow, ...] = ()
    records: tuple[SyncRecord, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass
class _Caches:
    manifest_bytes: bytes | None = None
    manifest: Manifest | None = None
    run_id: str | None = None
    headers: dict[str, HeaderInfo | FormatError] = field(default_factory=dict)
    metrics: dict[str, SyncRecord | FormatError] = field(default_factory=dict)


class BucketWatcher:
    """Polls one bucket; thread-safe, so every browser tab and API call can share it."""

    def __init__(self, store: Store, config: WatcherConfig | None = None):
        self.store = store
        self.config = config or WatcherConfig()
        self._lock = threading.Lock()
        self._cache = _Caches()
        self._last: Snapshot | None = None
        self._last_monotonic = 0.0

    def snapshot(self) -> Snapshot:
        """The latest poll's result, polling first unless one finished within `min_poll_s`."""
        with self._lock:
            fresh = time.monotonic() - self._last_monotonic < self.config.min_poll_s
            if self._last is None or not fresh:
                self._last = self._poll()
                self._last_monotonic = time.monotonic()
            return self._last

    def _poll(self) -> Snapshot:
        deadline = time.monotonic() + self.config.budget_s
        reads = [self.config.max_reads]  # shared countdown of fetches left in this poll
        problems: list[str] = []
        try:
            manifest = self._read_manifest()
        except FormatError as exc:
            return self._snap("error", f"`manifest.json` is unreadable: {exc}")
        except StoreError as exc:
            return self._stale(f"the bucket could not be read: {exc}")
        if manifest is None:
            return self._without_manifest()
        rows = self._read_headers(manifest, deadline, reads)
        records = self._read_metrics(manifest.run_id, deadline, reads, problems)
        problems[:0] = [
            f"version {r.entry.version} {r.entry.kind}: {r.detail}" for r in rows if r.detail
        ]
        have = {r.version for r in records}
        if manifest.latest_version not in have:
            problems.append(f"metrics for version {manifest.latest_version} not written yet")
        if reads[0] <= 0 or time.monotonic() > deadline:
            problems.append("more files to read than one refresh allows; continuing next refresh")
        bad = sum(r.status in ("corrupt", "unreadable") for r in rows)
        state: State = "error" if bad else "ok"
        message = f"run `{manifest.run_id}` at version {manifest.latest_version}" + (
            f"; {bad} file(s) marked in the table" if bad else ""
        )
        return self._snap(state, message, _health(manifest), rows, records, problems)

    def _snap(self, state: State, message: str, *args: object) -> Snapshot:
        return Snapshot(self.store.url, state, message, time.time(), *args)  # type: ignore[arg-type]

    def _stale(self, message: str) -> Snapshot:
        """A failed poll keeps the last good data on screen, marked as an error."""
        last = self._last
        if last is None or last.state == "empty":
            return self._snap("error", message)
        shown = time.strftime("%H:%M:%S", time.localtime(last.polled_at))
        return replace(last, state="error", message=f"{message} (showing data from {shown})")

    def _read_manifest(self) -> Manifest | None:
        data = read_manifest_bytes(self.store)
        if data is None:
            return None
        cache = self._cache
        if data != cache.manifest_bytes:
            manifest = Manifest.from_json(data)
            if manifest.run_id != cache.run_id:
                cache.metrics.clear()
            cache.manifest_bytes, cache.manifest, cache.run_id = data, manifest, manifest.run_id
        return cache.manifest

    def _without_manifest(self) -> Snapshot:
        try:
            started = self.store.list("runs")[:1]
        except StoreError as exc:
            return self._snap("error", f"no `manifest.json`, and listing `runs/` failed: {exc}")
        if started:
            return self._snap(
                "waiting",
                "files are arriving under `runs/` but there is no `manifest.json` yet: the "
                "trainer has not committed its first version",
            )
        return self._snap(
            "empty", "the bucket is empty: no `manifest.json` yet; start the trainer to fill it"
        )

    def _read_headers(self, manifest: Manifest, deadline: float, reads: list[int]) -> list[FileRow]:
        entries = sorted((*manifest.anchors, *manifest.deltas), key=lambda e: (e.version, e.kind))
        live = {e.label for e in entries}
        for path in [p for p in self._cache.headers if p not in live]:  # retention deleted them
            del self._cache.headers[path]
        rows = []
        for entry in reversed(entries):  # newest first: they matter most when the budget is short
            cached = self._cache.headers.get(entry.label)
            if cached is None and reads[0] > 0 and time.monotonic() < deadline:
                reads[0] -= 1
                cached = self._fetch_header(entry, manifest.run_id)
            rows.append(_row(entry, cached))
        return rows

    def _fetch_header(self, entry: ChainEntry, run_id: str) -> HeaderInfo | FormatError | str:
        """A parsed header, a cached corruption, or (not cached) why it could not be read now."""
        try:
            info: HeaderInfo | FormatError = read_header(self.store, entry, run_id)
        except MissingFile:
            return "pending: named by the manifest but not listed by the bucket yet"
        except FormatError as exc:
            info = exc
        except DeltaSyncError as exc:
            return f"unreadable: {exc}"
        self._cache.headers[entry.label] = info
        return info

    def _read_metrics(
        self, run_id: str, deadline: float, reads: list[int], problems: list[str]
    ) -> list[SyncRecord]:
        folder = f"runs/{run_id}/metrics"
        try:
            listed = self.store.list(folder)
        except StoreError as exc:
            problems.append(f"listing {folder}/ failed: {exc}")
            listed = list(self._cache.metrics)
        named = [p for p in listed if _METRICS_NAME.fullmatch(p.rsplit("/", 1)[-1])]
        keep = sorted(named, key=lambda p: int(p.rsplit("/", 1)[-1][:-5]))
        keep = keep[-self.config.max_versions :]
        kept = set(keep)
        for path in [p for p in self._cache.metrics if p not in kept]:
            del self._cache.metrics[path]
        for path in reversed(keep):
            if path in self._cache.metrics or reads[0] <= 0 or time.monotonic() > deadline:
                continue
            reads[0] -= 1
            try:
                data = self.store.get(path, limit=MAX_RECORD_BYTES)  # never reads past it
                self._cache.metrics[path] = SyncRecord.from_json(data, path=path)
            except MissingFile:
                continue
            except RefusedObject as exc:  # records are immutable: refused once, for good
                self._cache.metrics[path] = FormatError(str(exc), path=path)
            except FormatError as exc:
                self._cache.metrics[path] = exc
            except StoreError as exc:
                problems.append(f"{path}: {exc}")
        records = []
        for path in keep:
            value = self._cache.metrics.get(path)
            if isinstance(value, FormatError):
                problems.append(f"corrupt metrics record: {value}")
            elif value is not None:
                records.append(value)
        if records:  # replicas lagging at the newest version (older lags are history)
            newest = records[-1]
            problems.extend(
                f"version {newest.version}: replica {r.name} did not sync after {r.attempts} "
                f"attempt(s): {r.error}"
                for r in newest.replicas
                if not r.ok
            )
        return records


def _row(entry: ChainEntry, cached: HeaderInfo | FormatError | str | None) -> FileRow:
    if isinstance(cached, HeaderInfo):
        return FileRow(entry, "ok", header=cached)
    if isinstance(cached, FormatError):
        return FileRow(entry, "corrupt", f"corrupt: {cached}")
    if cached is None:
        return FileRow(entry, "pending", "pending: header not read yet")
    status = "pending" if cached.startswith("pending") else "unreadable"
    return FileRow(entry, status, cached)


def _health(manifest: Manifest) -> Health:
    anchor = manifest.latest_anchor
    after = manifest.deltas_after(anchor.version)
    return Health(
        run_id=manifest.run_id,
        latest_version=manifest.latest_version,
        latest_anchor=anchor.version,
        replay_bytes=anchor.fetch_bytes + sum(d.bytes for d in after),
        replay_files=len(anchor.files) + sum(len(d.files) for d in after),
        model_bytes=manifest.model_bytes,
        anchors=len(manifest.anchors),
        deltas=len(manifest.deltas),
        updated_at=manifest.updated_at,
    )
