"""Per-rank diff + encode time, bytes and memory of sharded publishing (FSDP2 `fully_shard`).

Launches `torchrun --standalone --nproc_per_node R` for each rank count R; every rank holds its
rows of a Qwen3-shaped model (R = 1: the whole model, unsharded), moves a share of its elements
per step as `bench.synthetic` does (89 % by one bit-pattern step), and publishes each step to a
local bucket. Reported per rank: the diff (training thread), encode (incl. the full-state
digest) and upload seconds, the process's CPU seconds for the whole publish (all threads: what a
rank costs when ranks do not share cores, as they do on this 2-core machine), part bytes, and the
publisher's memory: its snapshot (the rank's shard in bf16) plus the peak extra RSS while a
version is published over the RSS before it (after one warm-up delta that compiles the loops),
next to the allowance of the rank's shard plus its largest full parameter in bf16.

Usage:
  .venv/bin/python -m bench.sharded --shape qwen3-0.6b --ranks 1 2 --steps 3 \
      --density 0.02 --json bench/results/sharded-qwen3-0.6b.json
  # one core per rank (rank r on core r), as ranks on hosts of their own:
  .venv/bin/python -m bench.sharded --shape qwen3-0.6b --ranks 1 2 --steps 3 --pin \
      --density 0.02 --json bench/results/sharded-qwen3-0.6b-pinned.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deltasync.arguments import count, fraction, json_path

from .output import report

__all__ = ["main"]


def _worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): build, shard, step, publish; write this rank's figures."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    from deltasync import Publisher, PublisherConfig
    from deltasync.publisher.shards import ShardGroup, local_rows
    from deltasync.store import LocalStore
    from deltasync.wire.policy import AnchorPolicy

    from .memory import PeakRss
    from .models.qwen3 import SHAPES, build_config

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.pin:  # one core per rank, as ranks on their own hosts would have
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(build_config(SHAPES[args.shape]))
    if size > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty leaves tied embeddings as two tensors
    generator = torch.Generator().manual_seed(rank)
    local, layout = local_rows(model)
    with torch.no_grad():
        for tensor in local.values():
            tensor.copy_((torch.randn(tensor.shape, generator=generator) * 0.02).bfloat16())
    shard_bytes = 2 * sum(t.numel() for t in local.values())
    largest = 2 * max(int(np.prod(s.shape)) for s in layout.values())
    rng = np.random.default_rng(rank)
    config = PublisherConfig(
        run_id="bench-sharded",
        policy=AnchorPolicy(interval=None, max_delta_fraction=None),
        write_metrics=False,
    )
    rows = []
    with Publisher(LocalStore(args.bucket), config, shards=ShardGroup()) as publisher:
        publisher.publish(model).result()  # version 1: the anchor and the snapshot
        process = psutil.Process()
        for step in range(args.steps + 1):  # the first delta compiles the loops: not reported
            with torch.no_grad():
                for tensor in local.values():
                    flat = tensor.detach().view(-1)
                    count = max(1, round(args.density * flat.numel()))
                    index = torch.from_numpy(np.unique(rng.integers(0, flat.numel(), count)))
                    moves = rng.choice([1, 2, 3], index.numel(), p=[0.89, 0.08, 0.03])
                    bits = flat[index].bfloat16().view(torch.int16)
                    moved = bits + torch.from_numpy(moves.astype(np.int16))
                    flat[index] = moved.view(torch.bfloat16).to(flat.dtype)
            dist.barrier()
            cpu = time.process_time()
            with PeakRss(process, 0.01, tree=False) as rss:
                record = publisher.publish(model).result()
            cpu = time.process_time() - cpu
            mine = publisher.last_parts[rank] if size > 1 else None
            if step == 0:
                continue
            rows.append(
                {
                    "diff_s": mine["diff_s"] if mine else record.diff_s,
                    "encode_s": mine["encode_s"] if mine else record.encode_s,
                    "upload_s": mine["upload_s"] if mine else record.upload_s,
                    "bytes": mine["bytes"] if mine else record.delta_bytes,
                    "changed": mine["changed"] if mine else record.changed_elements,
                    "elements": mine["elements"] if mine else record.total_elements,
                    "peak_extra_bytes": rss.extra,
                    "cpu_s": cpu,
                }
            )
    out = {"rank": rank, "ranks": size, "shard_bytes": shard_bytes, "largest_param": largest}
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(out | {"steps": rows}))
    dist.destroy_process_group()


def _run(shape: str, ranks: int, steps: int, density: float, pin: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node", str(ranks), "-m", "bench.sharded", "--worker"]
        command += ["--shape", shape, "--steps", str(steps), "--density", str(density)]
        command += ["--bucket", f"{tmp}/bucket", "--out", f"{tmp}/figures"]
        command += ["--pin"] if pin else []
        threads = 1 if pin else max(1, (os.cpu_count() or 2) // ranks)
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return [json.loads(Path(f"{tmp}/figures.rank{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    from .models.qwen3 import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=count, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=count, default=3)
    ap.add_argument("--density", type=fraction, default=0.02)
    ap.add_argument(
        "--pin", action="store_true", help="pin each rank to one core of its own (rank r: core r)"
    )
    ap.add_argument("--json", type=json_path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    lines = [
        "| ranks | rank | shard bf16 MB | density | part MB | diff s | encode s | diff+encode s "
        "| CPU s | publisher MB (snapshot + peak extra) | shard + largest param MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    results = {}
    for ranks in args.ranks:
        figures = _run(args.shape, ranks, args.steps, args.density, args.pin)
        results[str(ranks)] = figures
        for fig in figures:
            steps = fig["steps"]
            med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            lines.append(
                f"| {ranks} | {fig['rank']} | {fig['shard_bytes'] / 1e6:.0f} "
                f"| {med['changed'] / med['elements']:.2%} | {med['bytes'] / 1e6:.1f} "
                f"| {med['diff_s']:.2f} | {med['encode_s']:.2f} "
                f"| {med['diff_s'] + med['encode_s']:.2f} | {med['cpu_s']:.2f} "
                f"| {(fig['shard_bytes'] + max(s['peak_extra_bytes'] for s in steps)) / 1e6:.0f} "
                f"| {(fig['shard_bytes'] + fig['largest_param']) / 1e6:.0f} |"
            )
    placement = "each rank pinned to a core of its own" if args.pin else "ranks share the cores"
    footer = (
        f"\n{args.shape}, {args.steps} synthetic steps per rank count, medians; "
        f"{os.cpu_count()} cpus, {placement}"
    )
    report("\n".join(lines) + footer, {"shape": args.shape, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
