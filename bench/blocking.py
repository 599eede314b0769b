"""Trainer blocking time per step: what `Publisher.publish` costs the training thread.

Side by side on the same steps (synthetic, at a fixed density) of fp32 master weights:
- `host`: the host path as `publish` runs it on a CPU trainer: bf16 view, compiled scan and each
  tensor's xxh3 while its bytes are hot;
- `host, no hashing`: the same scan without the digests (what hashing costs the training thread);
- `device`: the on-device compare against a bf16 reference, here with `device=cpu` (a GPU
  trainer runs the same code on the GPU, where `python -m bench.gpu` measures it; on CPU the
  host path is the one `change_detection="auto"` picks);
- `digests (worker)`: what hashing the host mirror costs the publisher's worker in device mode.

Usage:
  .venv/bin/python -m bench.blocking --model qwen3-0.6b --density 0.02 --steps 4 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from deltasync.arguments import count, fraction, json_path
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.snapshot import Bf16Snapshot, digests_after

from .output import save_json
from .realistic import SHAPES
from .synthetic import synthetic_states


def _timed(fn, *args, repeat: int = 1, **kwargs):
    """(the first call's result, the best wall time of `repeat` calls)."""
    out, best = None, float("inf")
    for i in range(repeat):
        t0 = time.perf_counter()
        found = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
        out = found if i == 0 else out
        del found
    return out, best


def measure(model: str, *, density: float, steps: int, repeat: int) -> list[dict]:
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
        # best of `repeat` for the host modes (pure); the device mode moves its reference, so
        # it runs once per step (the median over steps is what the table shows)
        diff, host_s = _timed(host.diff, params, digests=False, repeat=repeat)
        before, before_s = _timed(host.diff, params, digests=True, repeat=repeat)
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
    ap.add_argument("--density", type=fraction, default=0.02)
    ap.add_argument("--steps", type=count, default=4)
    ap.add_argument("--repeat", type=count, default=3, help="best of N for the host modes")
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    rows = measure(args.model, density=args.density, steps=args.steps, repeat=args.repeat)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    print(f"### {args.model}, {len(rows)} steps at {100 * med['density']:.2f} % density")
    print("| mode | blocking s (median) | vs the host path |")
    print("|---|---|---|")
    for key, label in (
        ("before_s", "host path: bf16 view + scan + per-tensor hashes (CPU trainer)"),
        ("host_s", "host path without the hashes"),
        ("device_s", "device mode on CPU tensors (device=cpu)"),
    ):
        print(f"| {label} | {med[key]:.3f} | {med['before_s'] / med[key]:.2f}x |")
    print(f"\ndevice mode: hashing the host mirror in the worker, {med['digests_worker_s']:.3f} s")
    print(f"threads {torch.get_num_threads()}/{os.cpu_count()} cpus")
    save_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
