"""What the parts of the one-shot GPU check (`scripts/gpu_check.sh`) share.

Every part is a module run as `python -m bench.gpu_<part> --device {cuda,cpu} [--small] --json F`:
it writes its JSON to F as results come in (a part killed by its `timeout` leaves what it had,
`"complete": false`), ends with `"ok": true` only when every check held, and exits non-zero
otherwise. On `--device cpu` (the CI dry run) the same code runs on CPU tensors; checks that
need CUDA (graphs, memory caps, transfer and sync counts) are reported as skipped, never faked.

Measuring tools, profiler-free:
- `Transfers`: a `TorchDispatchMode` that adds up bytes copied between the host and a device
  (`_to_copy` / `copy_` across devices) and counts the aten calls that wait for the device
  (`nonzero`, `item`, copies to the host, ...); `torch.cuda.synchronize` calls are counted too.
- `Peak`: `torch.cuda.max_memory_allocated` over a block, minus what was allocated before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync.arguments import json_path, torch_device

from .models.qwen3 import SHAPES, Shape

__all__ = [
    "GPU_SHAPES",
    "Part",
    "Peak",
    "Transfers",
    "device_of",
    "part_main",
    "shape_of",
    "synchronize",
    "timed",
]

# Qwen3-8B (hidden 4096, 36 layers, 32 heads, 8 kv heads, intermediate 12288, untied head):
# 8.19B parameters, 16.4 GB bf16. The vLLM stand-in ties its head (`shape_of(..., tied=True)`).
QWEN3_8B = Shape(4096, 36, 32, 8, 128, 12288, 151936, tied=False)
# The dry run's shape: every kind of tensor of a Qwen3, in tens of kilobytes (CI's 2 busy cores).
QWEN3_MICRO = Shape(64, 2, 4, 2, 16, 128, 1000)
GPU_SHAPES: dict[str, Shape] = {**SHAPES, "qwen3-8b": QWEN3_8B, "qwen3-micro": QWEN3_MICRO}


def shape_of(name: str, *, layers: int | None = None, tied: bool | None = None) -> Shape:
    """A named shape (the realistic ones plus `qwen3-8b`), optionally cut to `layers` layers."""
    shape = GPU_SHAPES[name]
    if layers is not None:
        shape = replace(shape, layers=layers)
    if tied is not None:
        shape = replace(shape, tied=tied)
    return shape


def device_of(text: str) -> torch.device:
    """`cuda` as the tensors report it (`cuda:0`, the current device), else the device named."""
    device = torch.device(text)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """`fn(*args, **kwargs)` and its wall time, the device synchronized before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    synchronize(device)
    return out, time.perf_counter() - t0


_aten = torch.ops.aten
_WAITS = {  # aten calls that make the host wait for the device
    _aten.nonzero.default,
    _aten._local_scalar_dense.default,
    _aten.equal.default,
    _aten.masked_select.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
}


class Transfers(TorchDispatchMode):
    """Bytes copied host <-> device and host waits (blocking copies to the host, `nonzero`,
    `item`, ...: an estimate without a profiler) by the thread inside the `with` block, plus
    `torch.cuda.synchronize` calls from any thread. On CPU-only runs every figure stays 0."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host = 0
        self.to_device = 0
        self.waits = 0
        self.synchronize_calls = 0
        self._synchronize = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = dst = None
        blocking = True
        if func is _aten._to_copy.default and isinstance(out, torch.Tensor):
            src, dst, blocking = args[0], out, not kwargs.get("non_blocking", False)
        elif func is _aten.copy_.default:
            src, dst = args[1], args[0]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(src, torch.Tensor) and src.device != dst.device:
            size = dst.numel() * dst.element_size()
            if dst.device.type == "cpu":
                self.to_host += size
                self.waits += blocking
            elif src.device.type == "cpu":
                self.to_device += size
        elif func in _WAITS and any(
            isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args
        ):
            self.waits += 1
        return out

    def __enter__(self):
        self._synchronize = torch.cuda.synchronize

        def counted(*args, **kwargs):
            self.synchronize_calls += 1
            return self._synchronize(*args, **kwargs)

        torch.cuda.synchronize = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.synchronize = self._synchronize
        return super().__exit__(*exc)

    def figures(self) -> dict:
        return {
            "bytes_to_host": self.to_host,
            "bytes_to_device": self.to_device,
            "host_waits": self.waits,
            "synchronize_calls": self.synchronize_calls,
        }


class Peak:
    """Transient device memory of a block: peak allocated minus allocated before (None on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> Peak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base


class Part:
    """One part's JSON, rewritten as results come in (so a timeout keeps what was measured)."""

    def __init__(self, name: str, path: str | None, device: torch.device, small: bool):
        self.path = path
        self.started = time.perf_counter()
        self.result: dict = {
            "part": name,
            "ok": False,
            "complete": False,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "device_type": device.type,
            "small": small,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "skipped": [],
        }

    def update(self, **items) -> None:
        self.result.update(items)
        self.save()

    def skip(self, what: str) -> None:
        """A check not run here (and why), listed in the JSON instead of being faked."""
        self.result["skipped"].append(what)
        self.save()

    def save(self) -> None:
        self.result["wall_s"] = time.perf_counter() - self.started
        if self.path:
            tmp = f"{self.path}.tmp"
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1, default=str)
            os.replace(tmp, self.path)


def mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.0f} MiB"  # None: not measured (CPU)


def part_main(
    name: str,
    doc: str,
    run: Callable[[argparse.Namespace, Part, torch.device], bool],
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    table: Callable[[dict], str] | None = None,
) -> int:
    """Parse `--device`, `--small`, `--json` (and `extra`'s options), run, and record `ok`:
    `run` returns whether every check held; an exception is recorded with its traceback. A
    complete part keeps `table` of its result as `markdown` (BENCHMARKS.md shows it)."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.split("\n")[0])
    p.add_argument("--device", type=torch_device, default="cuda")
    p.add_argument("--small", action="store_true", help="small shapes, few steps (CI dry run)")
    p.add_argument("--json", type=json_path, default=None, help="write the result here")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    device = device_of(args.device)
    part = Part(name, args.json, device, args.small)
    try:
        ok = bool(run(args, part, device))
    except BaseException as exc:  # recorded, then the part fails (the script goes on)
        part.update(
            ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
        )
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    part.update(ok=ok, complete=True)
    if table is not None:
        part.update(markdown=table(part.result))
    print(json.dumps(part.result, indent=1, default=str), flush=True)
    return 0 if ok else 1
