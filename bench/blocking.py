"""Trainer blocking time per step: what `Publisher.publish` costs the training thread.

Side by side on the same steps (synthetic, at a fixed density) of fp32 master weights:
- `before`: the host scan plus every tensor hashed on the training thread (what `publish` did);
- `host`: the host scan alone (the digests are now hashed by the publisher's worker);
- `device`: the on-device compare against a bf16 reference, here with `device=cpu` (on a GPU
  trainer the same code runs on the GPU; `python -m bench.gpu` measures it there);
- `digests (worker)`: the hashing moved off the training thread, for the record.

Usage:
  .venv/bin/python -m bench.blocking --model qwen3-0.6b --density 0.02 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from deltasync.device_snapshot import DeviceSnapshot
from deltasync.snapshot import Bf16Snapshot, digests_after

from .realistic import SHAPES
from .synthetic import synthetic_states


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def measure(model: str, *, density: float, steps: int) -> list[dict]:
    rows: list[dict] = []
    params: dict[str, torch.Tensor] = {}
    host = device = None
    for step, state in synthetic_states(model, steps, density=density):
        if step == 0:
            params = {n: t.float() for n, t in state.items()}  # fp32 master weights
            host = Bf16Snapshot({n: t.clone() for n, t in state.items()})
            device = DeviceSnapshot(Bf16Snapshot({n: t.clone() for n, t in state.items()}), "cpu")
            device.diff(params, digests=False)  # loads the reference (once per run)
            device.advance(device.diff(params, digests=False))
            continue
        for name, tensor in state.items():
            params[name].copy_(tensor)
        assert host is not None and device is not None
        before, before_s = _timed(host.diff, params, digests=True)
        diff, host_s = _timed(host.diff, params, digests=False)
        found, device_s = _timed(device.diff, params, digests=False)
        assert found.changed_elements == diff.changed_elements == before.changed_elements
        digests, digests_s = _timed(digests_after, host.tensors, diff)
        assert digests == before.digests
        rows.append(
            {
                "step": step,
                "density": diff.density,
                "before_s": before_s,
                "host_s": host_s,
                "device_s": device_s,
                "digests_worker_s": digests_s,
            }
        )
        print(
            f"step {step}: density {100 * diff.density:.2f} %, before {before_s:.3f} s, host "
            f"{host_s:.3f} s, device(cpu) {device_s:.3f} s, digests in the worker "
            f"{digests_s:.3f} s",
            file=sys.stderr,
            flush=True,
        )
        host.advance(diff)
        device.advance(found)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="trainer blocking time per step")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 0 < args.density < 1 or args.steps < 1:
        ap.error("--density must lie in (0, 1) and --steps be >= 1")
    rows = measure(args.model, density=args.density, steps=args.steps)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    print(f"### {args.model}, {len(rows)} steps at {100 * med['density']:.2f} % density")
    print("| mode | blocking s (median) | vs before |")
    print("|---|---|---|")
    for key, label in (
        ("before_s", "before: host scan + hashing on the training thread"),
        ("host_s", "host scan (digests hashed by the worker)"),
        ("device_s", "device compare (device=cpu)"),
    ):
        print(f"| {label} | {med[key]:.3f} | {med['before_s'] / med[key]:.2f}x |")
    print(f"\nhashing moved to the publisher's worker: {med['digests_worker_s']:.3f} s per step")
    print(f"threads {torch.get_num_threads()}/{os.cpu_count()} cpus")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
