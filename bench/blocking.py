"""Trainer blocking time per step: what `Publisher.publish` costs the training thread.

Side by side on the same steps (synthetic, at a fixed density) of fp32 master weights:
- `host`: the host path as `publish` runs it on a CPU trainer: bf16 view, compiled scan and each
  tensor's xxh3 while its bytes are hot;
- `host, no hashing`: the same scan without the digests (what hashing costs the training thread);
- `device`: the on-device compare against a bf16 reference, here with `device=cpu` (a GPU
  trainer runs the same code on the GPU, where `python -m bench.gpu` measures it; on CPU the
  host path is the one `change_detection="auto"` picks);
- `digests (worker)`: what hashing the host mirror costs the publisher's worker in device mode.

Then, with `--encodings`, the whole `Publisher.publish` per encoding, one after the other on the
same steps: a stand-in training step (`--train-s` seconds of fp32 matmuls on the training
thread) between publishes, so the publisher's worker encodes and uploads (to a local folder)
while the "trainer" computes, as in a run. Per encoding: what `publish` blocks (the diff, plus
any wait for a full queue when encoding falls behind) and the training step's throughput against
the same steps without a publisher (what the worker's cores cost the trainer).

Usage:
  .venv/bin/python -m bench.blocking --model qwen3-0.6b --density 0.02 --steps 4 --repeat 3
  .venv/bin/python -m bench.blocking --model qwen3-0.6b --density 0.02 --steps 4 --repeat 1 \
      --encodings ans ctx --train-s 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

from deltasync.arguments import count, folder, fraction, json_path, learning_rate, positive
from deltasync.codec import ENCODINGS
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot, digests_after
from deltasync.store import LocalStore

from .models.qwen3 import SHAPES
from .output import best_of, save_json
from .realistic import bf16_states
from .synthetic import synthetic_states


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
        diff, host_s, _ = best_of(partial(host.diff, params, digests=False), repeat)
        before, before_s, _ = best_of(partial(host.diff, params, digests=True), repeat)
        found, device_s, _ = best_of(partial(device.diff, params, digests=False), 1)
        assert found.changed_elements == diff.changed_elements == before.changed_elements
        digests, digests_s, _ = best_of(partial(digests_after, host.tensors, diff), 1)
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


def _train(seconds: float) -> float:
    """A stand-in training step: fp32 matmuls for `seconds` on this thread; returns how many
    ran per second (what a publisher's worker threads take away shows as fewer)."""
    a = torch.randn(384, 384)
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(8):
            a = torch.tanh(a @ a)
        done += 8
    return done / elapsed


def publish_side_by_side(
    model: str,
    *,
    density: float,
    steps: int,
    train_s: float,
    encodings: list[str],
    lr: float | None = None,
    cache: str | None = None,
) -> dict[str, list[dict]]:
    """Per encoding (and `none`: the same steps, no publisher), each step's training throughput
    and what `publish` blocked; the worker's encode seconds from the version's record. The
    steps are synthetic at `density`, or with `lr` the realistic run's (`bench.realistic`)."""

    def states():
        if lr is None:
            return synthetic_states(model, steps, density=density)
        return bf16_states(model, steps, lr=lr, cache=cache, log=lambda m: None)

    out: dict[str, list[dict]] = {}
    _train(train_s)  # warms torch's threads and allocator
    for encoding in ["none", *encodings, "none after"]:  # `none` first and last: drift shows
        rows: list[dict] = []
        with tempfile.TemporaryDirectory(prefix="blocking-") as folder:
            publisher = None
            if not encoding.startswith("none"):
                config = PublisherConfig(run_id="blocking", encoding=encoding, write_metrics=False)
                publisher = Publisher(LocalStore(folder), config)
            params: dict[str, torch.Tensor] = {}
            futures = []
            for step, state in states():
                if step == 0:
                    params = {n: t.float() for n, t in state.items()}
                else:
                    for name, tensor in state.items():
                        params[name].copy_(tensor)
                rate = _train(train_s)
                t0 = time.perf_counter()
                if publisher is not None:
                    futures.append(publisher.publish(params))
                blocked = time.perf_counter() - t0
                if step > 0:
                    rows.append({"step": step, "train_rate": rate, "publish_s": blocked})
            if publisher is not None:
                publisher.close()
                for row, future in zip(rows, futures[1:], strict=True):
                    record = future.result()
                    row |= {"encode_s": record.encode_s, "delta_bytes": record.delta_bytes}
        out[encoding] = rows
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
        print(f"{encoding}: {med}", file=sys.stderr, flush=True)
    return out


def publish_table(result: dict[str, list[dict]], train_s: float) -> str:
    """`Publisher.publish` per encoding against runs without a publisher before and after."""
    med = {
        enc: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
        for enc, rows in result.items()
    }
    before, after = med.pop("none"), med.pop("none after")
    base = {"train_rate": (before["train_rate"] + after["train_rate"]) / 2}
    first = next(iter(med))
    lines = [
        f"`Publisher.publish` per encoding, a {train_s:g} s stand-in training step between",
        "",
        f"| encoding | publish blocks s (median) | vs {first} | worker encode s | delta MB | "
        "training throughput vs no publisher |",
        "|---|---|---|---|---|---|",
    ]
    for enc, m in med.items():
        lines.append(
            f"| {enc} | {m['publish_s']:.3f} | {m['publish_s'] / med[first]['publish_s']:.2f}x | "
            f"{m['encode_s']:.2f} | {m['delta_bytes'] / 1e6:.1f} | "
            f"{m['train_rate'] / base['train_rate']:.2f}x |"
        )
    drift = after["train_rate"] / before["train_rate"]
    lines.append(f"(no publisher: the last run's throughput {drift:.2f}x the first's)")
    return "\n".join(lines)


def detection_table(rows: list[dict]) -> str:
    """Each change-detection mode's blocking time, medians over the steps."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    lines = [
        f"{len(rows)} steps at {100 * med['density']:.2f} % density",
        "",
        "| mode | blocking s (median) | vs the host path |",
        "|---|---|---|",
    ]
    for key, label in (
        ("before_s", "host path: bf16 view + scan + per-tensor hashes (CPU trainer)"),
        ("host_s", "host path without the hashes"),
        ("device_s", "device mode on CPU tensors (device=cpu)"),
    ):
        lines.append(f"| {label} | {med[key]:.3f} | {med['before_s'] / med[key]:.2f}x |")
    worker = med["digests_worker_s"]
    lines.append(f"\ndevice mode: hashing the host mirror in the worker, {worker:.3f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="trainer blocking time per step")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--density", type=fraction, default=0.02)
    ap.add_argument("--steps", type=count, default=4)
    ap.add_argument("--repeat", type=count, default=3, help="best of N for the host modes")
    ap.add_argument(
        "--encodings",
        nargs="*",
        choices=ENCODINGS,
        default=[],
        help="also run Publisher.publish side by side with these encodings",
    )
    ap.add_argument(
        "--train-s", type=positive, default=3.0, help="stand-in training step (default 3 s)"
    )
    ap.add_argument(
        "--lr",
        type=learning_rate,
        default=None,
        help="publish the realistic run's steps at this learning rate instead of synthetic ones",
    )
    ap.add_argument("--cache", type=folder, default=None, help="the realistic run's cache")
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    rows = measure(args.model, density=args.density, steps=args.steps, repeat=args.repeat)
    text = f"### {args.model}, {detection_table(rows)}"
    published = {}
    if args.encodings:
        published = publish_side_by_side(
            args.model,
            density=args.density,
            steps=args.steps,
            train_s=args.train_s,
            encodings=args.encodings,
            lr=args.lr,
            cache=args.cache,
        )
        text += "\n\n" + publish_table(published, args.train_s)
    print(text)
    print(f"threads {torch.get_num_threads()}/{os.cpu_count()} cpus")
    save_json({"detection": rows, "publish": published, "markdown": text}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
