"""Store calls and commit-to-serving time through a bucket with real latency
(`deltasync.store.latency.LatencyStore`: a round trip per call, a bandwidth cap per stream).

For each latency, a publisher writes `--versions` versions of a Qwen3 shape (synthetic steps at
`--density`) into a folder bucket behind the wrapper; a driven replica syncs each version once
its publish resolves, told the version's file (as the trainer does: the file is read beside the
manifest), and a follower polls the manifest every `--poll-s` and syncs when it changed (as
`serve --follow` does: its poll, then a sync that plans from the bytes the poll read). Each side
has its own wrapper, so its calls are counted apart. The next version is
published once both replicas hold the last one, after a random part of a poll interval. Then a
cold start reads one `--anchor-mb` anchor as one stream and as parallel ranged reads
(`Store.get_sized`).

Usage:
  .venv/bin/python -m bench.latency_store --json bench/results/latency-store.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltasync import Publisher, PublisherConfig, Replica
from deltasync.arguments import count, folder, fraction, json_path, non_negative, positive, scratch
from deltasync.store import LocalStore, Store
from deltasync.store.latency import Call, LatencyStore
from deltasync.wire.manifest import fetch_entry, read_manifest, read_manifest_bytes
from deltasync.wire.metrics import SyncRecord

from .models.qwen3 import SHAPES
from .output import report
from .synthetic import synthetic_states

RUN_ID = "latency"
MB = 1e6


def tally(calls: Sequence[Call]) -> str:
    """`target.kind xN` for each kind of call, e.g. `manifest.get x1, delta.get x1`."""
    found = Counter(f"{c.target}.{c.kind}" for c in calls)
    return ", ".join(f"{name} x{n}" for name, n in sorted(found.items()))


class Follower:
    """A follower's loop, as `serve --follow` runs it: read the manifest every `poll_s`; when
    it changed, sync from the bytes just read (nothing reads the manifest again)."""

    def __init__(self, store: Store, poll_s: float):
        self.store, self.poll_s = store, poll_s
        self.replica = Replica()
        self.held_at: dict[int, float] = {}  # version -> when it was first held
        self.sync_calls: dict[int, list[Call]] = {}  # version -> the poll that saw it + its sync
        self.idle_polls: list[list[Call]] = []  # the calls of each poll that found nothing new
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Follower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        seen = None
        while not self._stop.is_set():
            started, mark = time.monotonic(), len(self.store.calls)
            data = read_manifest_bytes(self.store)
            if data == seen:
                if data is not None:  # a bucket that holds versions, not an empty one
                    self.idle_polls.append(self.store.calls[mark:])
            else:
                seen = data
                for version in self.replica.sync(self.store, manifest=data):
                    self.held_at.setdefault(version, time.monotonic())
                    self.sync_calls.setdefault(version, self.store.calls[mark:])
            self._stop.wait(max(0.0, self.poll_s - (time.monotonic() - started)))

    def wait_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the follower did not get there in time")
            time.sleep(0.005)


def run_versions(args: argparse.Namespace, latency_s: float) -> dict[str, Any]:
    """Publish, drive and follow `args.versions` versions at one latency."""
    bucket = LocalStore(scratch(args.workdir, "latency-store-"))
    wrap = {"latency_s": latency_s, "bandwidth": args.bandwidth_mb * MB}
    pub_store, driven_store, follow_store = (LatencyStore(bucket, **wrap) for _ in range(3))
    config = PublisherConfig(RUN_ID, write_metrics=False)  # the trainer writes the record
    driven = Replica()
    rows: list[dict[str, Any]] = []
    states = synthetic_states(args.model, args.versions - 1, density=args.density)
    phase = random.Random(0)
    with Publisher(pub_store, config) as publisher, Follower(follow_store, args.poll_s) as follower:
        for _, state in states:
            marks = [len(s.calls) for s in (pub_store, driven_store)]
            started = time.monotonic()
            record: SyncRecord = publisher.publish(state).result()
            named = record.delta_path or record.anchor_path  # what the trainer tells replicas
            driven.sync(driven_store, target=record.version, path=named)
            served = time.monotonic()
            version = record.version
            follower.wait_until(lambda: version in follower.held_at)  # noqa: B023
            time.sleep(phase.uniform(0, args.poll_s))  # the next step lands anywhere in a poll
            pub_store.put(f"runs/{RUN_ID}/metrics/{record.version:08d}.json", record.to_json())
            commit = next(c.at for c in pub_store.calls[marks[0] :] if c.kind == "swap")
            sides = (pub_store.calls[marks[0] :], driven_store.calls[marks[1] :])
            follow = follower.sync_calls[record.version]
            rows.append(
                {
                    "version": record.version,
                    "kind": record.kind,
                    "file_bytes": record.delta_bytes or record.anchor_bytes,
                    "density": 1 - record.sparsity,
                    "publisher_calls": len(sides[0]),
                    "publisher": tally(sides[0]),
                    "driven_calls": len(sides[1]),
                    "driven": tally(sides[1]),
                    "follower_calls": len(follow),
                    "follower": tally(follow),
                    "publish_to_commit_s": commit - started,
                    "driven_s": served - started,
                    "driven_after_commit_s": served - commit,
                    "follower_s": follower.held_at[record.version] - started,
                }
            )
        follower.wait_until(lambda: len(follower.idle_polls) >= 2)
    idle = follower.idle_polls
    deltas = [r for r in rows if r["version"] > 1]
    return {
        "latency_ms": round(latency_s * 1000),
        "versions": rows,
        "idle_poll_calls": statistics.mean(len(p) for p in idle),
        "idle_poll": tally(idle[-1]),
        "delta_bytes": statistics.mean(r["file_bytes"] for r in deltas),
        "anchor_bytes": rows[0]["file_bytes"],
        "density": statistics.mean(r["density"] for r in deltas),
        **{
            f"{side}_p50_s": statistics.median(r[f"{side}_s"] for r in deltas)
            for side in ("publish_to_commit", "driven", "driven_after_commit", "follower")
        },
        "follower_max_s": max(r["follower_s"] for r in deltas),
    }


def cold_starts(args: argparse.Namespace, latencies: Sequence[float]) -> list[dict[str, Any]]:
    """One anchor of about `args.anchor_mb` MB, read as one stream and as parallel ranges."""
    bucket = LocalStore(scratch(args.workdir, "latency-anchor-"))
    rows, cols = 256, 4096  # 2 MiB tensors
    tensors = max(1, round(args.anchor_mb * MB / (2 * rows * cols)))
    generator = torch.Generator().manual_seed(0)
    state = {
        f"w{i}": torch.randn(rows, cols, generator=generator).to(torch.bfloat16)
        for i in range(tensors)
    }
    with Publisher(bucket, PublisherConfig(RUN_ID, write_metrics=False)) as publisher:
        publisher.publish(state).result()
    del state
    manifest = read_manifest(bucket)
    assert manifest is not None
    anchor = manifest.latest_anchor
    rows = []
    for latency_s in latencies:  # the same bytes on disk: the page cache serves every read
        for workers in (1, LatencyStore.range_workers):
            store = LatencyStore(bucket, latency_s=latency_s, bandwidth=args.bandwidth_mb * MB)
            store.range_workers, store.range_bytes = workers, round(args.range_mb * MB)
            started = time.monotonic()
            for _ in fetch_entry(store, anchor).stream():  # as a reader reads it: in pieces
                pass
            seconds = time.monotonic() - started
            rows.append(
                {
                    "latency_ms": round(latency_s * 1000),
                    "streams": workers,
                    "anchor_bytes": anchor.bytes,
                    "calls": len(store.calls),
                    "seconds": seconds,
                    "mb_per_s": anchor.bytes / MB / seconds,
                }
            )
    return rows


def table(res: dict[str, Any]) -> str:
    runs, cold = res["runs"], res["cold_starts"]
    first = runs[0]
    lines = [
        f"{res['model']}: anchor {first['anchor_bytes'] / MB:.2f} MB, deltas "
        f"{first['delta_bytes'] / 1e3:.1f} kB at density {first['density']:.2%} "
        f"(sparsity {1 - first['density']:.2%}), {res['versions']} versions, "
        f"{res['bandwidth_mb']:g} MB/s per stream, follower poll {res['poll_s']:g} s",
        "",
        "| latency | publisher calls/delta | driven calls/delta | follower calls/delta | "
        "idle poll calls | publish->commit p50 | driven p50 (after commit) | follower p50 / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        delta = run["versions"][-1]
        lines.append(
            f"| {run['latency_ms']} ms | {delta['publisher_calls']} | {delta['driven_calls']} | "
            f"{delta['follower_calls']} | "
            f"{run['idle_poll_calls']:g} | "
            f"{run['publish_to_commit_p50_s']:.3f} s | {run['driven_p50_s']:.3f} s "
            f"({run['driven_after_commit_p50_s']:.3f} s) | "
            f"{run['follower_p50_s']:.3f} / {run['follower_max_s']:.3f} s |"
        )
    last = runs[-1]["versions"][-1]
    lines += [
        "",
        f"Calls of one delta version: publisher {last['publisher']}; driven replica "
        f"{last['driven']}; follower {last['follower']}; idle poll {runs[-1]['idle_poll']}.",
        "",
        f"Cold start: reading one {cold[0]['anchor_bytes'] / MB:.0f} MB anchor "
        "(`fetch_entry` and `StoredFile.stream`: header, then pieces, size bound, xxh3 digest)",
        "",
        "| latency | streams | calls | seconds | MB/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['latency_ms']} ms | {r['streams']} | {r['calls']} | {r['seconds']:.2f} | "
        f"{r['mb_per_s']:.0f} |"
        for r in cold
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.latency_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="qwen3-tiny", choices=sorted(SHAPES))
    p.add_argument("--versions", type=count, default=5, help="versions published (default 5)")
    p.add_argument("--density", type=fraction, default=0.02, help="changed share per step")
    p.add_argument(
        "--latencies-ms", type=non_negative, nargs="+", default=[0, 50, 150], help="per call"
    )
    p.add_argument("--bandwidth-mb", type=positive, default=80.0, help="MB/s per stream")
    p.add_argument("--poll-s", type=positive, default=1.0, help="the follower's poll interval")
    p.add_argument("--anchor-mb", type=positive, default=200.0, help="cold start's anchor")
    p.add_argument("--range-mb", type=positive, default=16.0, help="bytes per ranged read")
    p.add_argument("--workdir", type=folder, default=None, help="where the buckets go")
    p.add_argument("--json", type=json_path, default=None, help="also write the results here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    latencies = [ms / 1000 for ms in args.latencies_ms]
    res = {
        "model": args.model,
        "versions": args.versions,
        "bandwidth_mb": args.bandwidth_mb,
        "poll_s": args.poll_s,
        "runs": [run_versions(args, latency_s) for latency_s in latencies],
        "cold_starts": cold_starts(args, latencies),
    }
    report(table(res), res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
