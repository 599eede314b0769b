"""Change detection on the device, what the training thread waits for: today's windows against
the compacted compare (issue 48), side by side; then `ctx` encode per version with 1 and 2
threads.

All run on CPU tensors (`device="cpu"`: the torch calls a GPU trainer makes; on a GPU what costs
is each wait, counted here by `bench.host_waits`):
- `today` (the detection before issue 48, kept here as the baseline, `TodaysDetection`): per
  tensor and per window of it, `nonzero` and two copies to the host, all on the training thread;
- `compacted` (`DeviceSnapshot`): a counting pass, one copy of the counts, a compaction pass into
  one buffer (`start_diff`, the training thread's share), then the copies and the per-tensor
  split (the returned call, run by the publisher's worker); both diffs must be equal bit for
  bit.
Steps: `--real SHAPE`, real AdamW steps of fp32 master weights (`bench.realistic`'s trainer,
trained once per detection from the same seed), and `--synthetic SHAPE`, synthetic steps at
`--density` of fp32 copies (`bench.synthetic`). Each detection runs alone over its own steps
(a 1.7B model's mirror, reference and fp32 weights fill this machine once).

Usage:
  .venv/bin/python -m bench.detection --real qwen3-0.6b --synthetic qwen3-1.7b --steps 3 \
      --density 0.02 --json bench/results/detection-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import xxhash

from deltasync.arguments import count, fraction, json_path
from deltasync.codec import ctx
from deltasync.kernels.changes import Diff, TensorChange, gather
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.snapshot import WINDOW, Bf16Snapshot, to_bf16

from .host_waits import HostWaits
from .models.qwen3 import SHAPES
from .output import report
from .realistic import _Trainer
from .synthetic import synthetic_states

__all__ = ["main"]

Steps = Callable[[], Iterator[dict[str, torch.Tensor]]]  # fp32 weights, moved in place per step
DETECTIONS = ("today", "compacted")


class TodaysDetection:
    """The device detection as it was before issue 48: a bf16 reference per tensor, compared
    window by window, each window's changes found with `nonzero` and copied to the host."""

    def __init__(self, host: Bf16Snapshot, to_host, window: int = WINDOW):
        self.host, self.to_host, self.window = host, to_host, window
        self.reference = {n: t.clone().reshape(-1) for n, t in host.tensors.items()}

    def start_diff(self, params: dict[str, torch.Tensor], *, digests: bool) -> Callable[[], Diff]:
        changes = {}
        for name, tensor in params.items():
            flat, reference = tensor.detach().reshape(-1), self.reference[name]
            indices, values = [], []
            for start in range(0, flat.numel(), self.window):
                new = to_bf16(flat[start : start + self.window])
                window = reference[start : start + new.numel()]
                local = (new.view(torch.int16) != window.view(torch.int16)).nonzero().squeeze(1)
                if local.numel() == 0:
                    continue
                found = new[local]
                window.copy_(new)
                indices.append(self.to_host(local.to(torch.int32)).to(torch.int64) + start)
                values.append(self.to_host(found))
            if indices:
                at = torch.cat(indices)
                previous = gather(self.host.tensors[name], at)
                changes[name] = TensorChange(at, torch.cat(values), previous)
        diff = Diff(changes, {}, {n: tuple(t.shape) for n, t in self.host.tensors.items()})
        return lambda: diff

    def advance(self, diff: Diff) -> None:
        self.host.advance(diff)


def real_steps(shape: str, steps: int) -> Steps:
    def run() -> Iterator[dict[str, torch.Tensor]]:
        trainer = _Trainer(shape, lr=1e-6, seed=0, batch=2, seq=128)
        params = dict(trainer.params)
        yield params
        for _ in range(steps):
            trainer.step()
            yield params

    return run


def synthetic_steps(shape: str, steps: int, density: float) -> Steps:
    def run() -> Iterator[dict[str, torch.Tensor]]:
        params: dict[str, torch.Tensor] = {}
        for step, state in synthetic_states(shape, steps, density=density):
            if step == 0:
                params = {n: t.float() for n, t in state.items()}
            else:
                for name, tensor in state.items():
                    params[name].copy_(tensor)
            yield params

    return run


def measure(steps: Steps, detection: str, encode: bool) -> list[dict]:
    """Per step: the training thread's seconds and waits, the worker's seconds, the density,
    and (with `encode`) `ctx` encode seconds with 1 and 2 threads."""
    rows = []
    snapshot = None
    copies: list[torch.Tensor] = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        copies.append(tensor)
        return tensor.to("cpu", copy=True)

    for step, params in enumerate(steps()):
        if snapshot is None:
            mirror = Bf16Snapshot.capture(params)
            if detection == "today":
                snapshot = TodaysDetection(mirror, to_host)
            else:
                snapshot = DeviceSnapshot(mirror, "cpu", to_host=to_host)
                snapshot.advance(snapshot.diff(params, digests=False))  # loads the reference
            continue
        copies.clear()
        with HostWaits() as waits:
            started = time.perf_counter()
            finish = snapshot.start_diff(params, digests=False)
            blocking = time.perf_counter() - started
            diff = finish()
            worker = time.perf_counter() - started - blocking
        row = {
            "step": step,
            "density": diff.density,
            "blocking_s": blocking,
            "worker_s": worker,
            "waits": waits.count + len(copies),
        }
        if detection == "today":  # the training thread waited for all of it
            row["blocking_s"], row["worker_s"] = blocking + worker, 0.0
        row["digest"] = _digest(diff)
        if encode:
            base = snapshot.host.tensors
            if step == 1:  # compiles the coder's loops, untimed
                ctx.encode_changes(diff.changes, base, diff.shapes, workers=1)
            for workers in (1, 2):
                started = time.perf_counter()
                ctx.encode_changes(diff.changes, base, diff.shapes, workers=workers)
                row[f"ctx_{workers}_s"] = time.perf_counter() - started
        rows.append(row)
        snapshot.advance(diff)
    return rows


def _digest(diff: Diff) -> str:
    """One hash of every change (names, indices, new and previous values)."""
    hasher = xxhash.xxh3_128()
    for name in sorted(diff.changes):
        change = diff.changes[name]
        hasher.update(name.encode())
        for tensor in (change.indices, change.values, change.previous):
            hasher.update(tensor.contiguous().view(torch.uint8).numpy())
    return hasher.hexdigest()


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _run(args: argparse.Namespace) -> dict:
    cases = []
    if args.real:
        cases.append((f"{args.real}, real AdamW steps", real_steps(args.real, args.steps)))
    if args.synthetic:
        what = f"{args.synthetic}, synthetic {100 * args.density:g} % steps"
        cases.append((what, synthetic_steps(args.synthetic, args.steps, args.density)))
    out: dict = {"steps": args.steps, "cases": {}}
    for name, steps in cases:
        out["cases"][name] = {
            detection: measure(steps, detection, encode=detection == "compacted")
            for detection in DETECTIONS
        }
        today, compacted = (out["cases"][name][d] for d in DETECTIONS)
        if [r["digest"] for r in today] != [r["digest"] for r in compacted]:
            raise SystemExit(f"{name}: the two detections found different changes")
        gc.collect()
    return out


def _tables(results: dict) -> str:
    lines = [
        "| steps | detection | density % | blocking s | worker s | host waits per diff |",
        "|---|---|---|---|---|---|",
    ]
    encode = [
        "| steps | density % | ctx encode s, 1 thread | 2 threads | speed-up |",
        "|---|---|---|---|---|",
    ]
    for name, detections in results["cases"].items():
        for detection, rows in detections.items():
            lines.append(
                f"| {name} | {detection} | {100 * _median(rows, 'density'):.2f} "
                f"| {_median(rows, 'blocking_s'):.3f} | {_median(rows, 'worker_s'):.3f} "
                f"| {max(r['waits'] for r in rows)} |"
            )
        rows = detections["compacted"]
        one, two = _median(rows, "ctx_1_s"), _median(rows, "ctx_2_s")
        encode.append(
            f"| {name} | {100 * _median(rows, 'density'):.2f} | {one:.2f} | {two:.2f} "
            f"| {one / two:.2f}x |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(encode)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--real", choices=sorted(SHAPES), default=None)
    p.add_argument("--synthetic", choices=sorted(SHAPES), default=None)
    p.add_argument("--steps", type=count, default=3)
    p.add_argument("--density", type=fraction, default=0.02)
    p.add_argument("--json", type=json_path, default=None)
    args = p.parse_args(argv)
    if not (args.real or args.synthetic):
        p.error("give --real SHAPE, --synthetic SHAPE or both")
    results = _run(args)
    report(_tables(results), results, args.json)


if __name__ == "__main__":
    main()
