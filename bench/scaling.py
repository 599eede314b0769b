"""Bytes and seconds per sync across model sizes (synthetic steps at a fixed density), for
extrapolating to larger models: change detection, encoding and a replica's decode+apply all
stream over the model once, so their time grows linearly with the parameter count; the payload
grows with parameters x density x bits per changed element.

Usage:
  .venv/bin/python -m bench.scaling --models qwen3-100m qwen3-0.6b qwen3-1.7b \
      --density 0.02 --steps 2 --json bench/results/scaling.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from functools import partial

import psutil

from deltasync.arguments import count, fraction, json_path
from deltasync.codec import encode_anchor
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica

from .codec import _encode_delta, _update
from .memory import PeakRss
from .models.qwen3 import SHAPES
from .output import best_of, save_json
from .synthetic import synthetic_states

RUN_ID = "bench-scaling"


def measure(model: str, *, density: float, steps: int, repeat: int) -> dict:
    rows = []
    snap = replica = sums = None
    params = 0
    for step, state in synthetic_states(model, steps, density=density):
        if step == 0:
            params = sum(t.numel() for t in state.values())
            snap = Bf16Snapshot({n: t.clone() for n, t in state.items()})
            sums = state_sums(state)
            replica = Replica()
            replica.update(encode_anchor(state, run_id=RUN_ID, version=1))
            continue
        gc.collect()
        with PeakRss(psutil.Process(), 0.05, tree=False) as rss:
            diff, diff_s, _ = best_of(partial(snap.diff, state), repeat)
            enc = partial(_encode_delta, diff, sums, version=step + 1)
            packed, encode_s, _ = best_of(partial(enc, encoding="packed"), repeat)
        coo = enc(encoding="coo")
        sums = apply_changes(sums, diff.changes)
        _, stage_s, commit_s, _ = _update(replica, packed, step, repeat)
        rows.append(
            {
                "step": step,
                "density": diff.density,
                "packed_bytes": len(packed),
                "coo_bytes": len(coo),
                "diff_s": diff_s,
                "encode_s": encode_s,
                "apply_s": stage_s + commit_s,
                "transient_bytes": rss.extra,
            }
        )
        print(
            f"{model} step {step}: diff {diff_s:.2f}s encode {encode_s:.2f}s apply "
            f"{stage_s + commit_s:.2f}s",
            file=sys.stderr,
            flush=True,
        )
        snap.advance(diff)
        del diff, packed, coo
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    return {"model": model, "params": params, "bf16_bytes": 2 * params, **median}


def markdown(results: list[dict], density: float) -> str:
    out = [
        "| shape | params | full bf16 GB | density | coo MB | packed MB | diff s | encode s | "
        "decode+apply s | (diff+encode) GB/s | peak extra MB (diff+encode) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        out.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f} B | {r['bf16_bytes'] / 1e9:.2f} | "
            f"{100 * r['density']:.2f} % | {r['coo_bytes'] / 1e6:.1f} | "
            f"{r['packed_bytes'] / 1e6:.1f} | {r['diff_s']:.2f} | {r['encode_s']:.2f} | "
            f"{r['apply_s']:.2f} | "
            f"{r['bf16_bytes'] / 1e9 / (r['diff_s'] + r['encode_s']):.2f} | "
            f"{r['transient_bytes'] / 1e6:.0f} |"
        )
    big = results[-1]
    per_param = {
        k: big[k] / big["params"] for k in ("diff_s", "encode_s", "apply_s", "packed_bytes")
    }
    out += [
        "",
        f"Linear extrapolation from {big['model']} at {100 * density:.1f} % density "
        "(per parameter, same 2-core CPU, one process):",
        "",
        "| model | packed MB | diff s | encode s | decode+apply s |",
        "|---|---|---|---|---|",
    ]
    for name, n in (("7B", 7.6e9), ("32B", 32.8e9), ("70B", 70.6e9), ("405B", 405.9e9)):
        out.append(
            f"| {name} | {per_param['packed_bytes'] * n / 1e6:.0f} | "
            f"{per_param['diff_s'] * n:.1f} | {per_param['encode_s'] * n:.1f} | "
            f"{per_param['apply_s'] * n:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        nargs="+",
        default=["qwen3-100m", "qwen3-0.6b", "qwen3-1.7b"],
        choices=sorted(SHAPES),
    )
    ap.add_argument("--density", type=fraction, default=0.02)
    ap.add_argument("--steps", type=count, default=2)
    ap.add_argument("--repeat", type=count, default=2, help="best of N per operation (default 2)")
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    results = [
        measure(m, density=args.density, steps=args.steps, repeat=args.repeat) for m in args.models
    ]
    table = markdown(results, args.density)
    table += (
        f"\n\nsynthetic steps, {args.steps} per shape, medians, best of {args.repeat}; "
        f"{os.cpu_count()} cpus; load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(table)
    save_json({"density": args.density, "results": results, "markdown": table}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
