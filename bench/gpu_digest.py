"""The full-state digest on a torch device: bit for bit against the compiled CPU loops, and what a
full pass and an O(changed) update cost there (the GPU replica's recompute and per-version move).

    PYTHONPATH=. python -m bench.gpu_digest                          # cuda, qwen3-8b shape
    PYTHONPATH=. python -m bench.gpu_digest --device cpu --small     # qwen3-micro: CI dry run

Part 6 of `scripts/gpu_check.sh`. Random states and changes are drawn on the device itself (an
8B state drawn on the host would take longer than the pass it measures).

Needs torch, numpy, numba, xxhash and transformers (for the shapes, on the meta device) only:
it runs on a bare GPU machine from the repository root. Checks, each one failing loudly:
- every tensor's digest on the device equals the compiled loops' on a host copy;
- slices as a tensor-parallel rank holds them (row halves, column halves by index) add up;
- elements past flat index 2^31 (a start offset) hash as on the host;
- an O(changed) update on the device equals a recompute after the change.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from deltasync.arguments import fraction
from deltasync.kernels.changes import TensorChange
from deltasync.kernels.state_hash import apply_changes, device_sum, state_sums, tensor_sum
from deltasync.wire.digests import total

from .gpu_common import GPU_SHAPES, part_main, shape_of, timed
from .synthetic import parameter_shapes

__all__ = ["main"]


def _random_bf16(shape: tuple[int, ...], device: torch.device, gen: torch.Generator):
    bits = torch.randint(
        -(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen, device=device
    )
    return bits.view(torch.bfloat16)


def run(model: str, device: torch.device, density: float) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = parameter_shapes(shape_of(model))
    state = {n: _random_bf16(s, device, gen) for n, s in shapes.items()}
    elements = sum(t.numel() for t in state.values())
    on_device, full_s = timed(device, lambda: {n: device_sum(n, t) for n, t in state.items()})
    host = {n: t.cpu() for n, t in state.items()}
    on_host, host_s = timed(torch.device("cpu"), lambda: state_sums(host))
    assert on_device == on_host, "device digests differ from the compiled loops"

    name, tensor = max(state.items(), key=lambda item: item[1].numel())
    rows, cols = tensor.shape[0], tensor.numel() // tensor.shape[0]
    halves = [
        device_sum(name, tensor[: rows // 2]),
        device_sum(name, tensor[rows // 2 :], start=(rows // 2) * cols),
    ]
    index = torch.arange(tensor.numel(), device=device).view(rows, cols)
    columns = [
        device_sum(name, tensor.view(rows, cols)[:, c], index=index[:, c])
        for c in (slice(0, cols // 2), slice(cols // 2, cols))
    ]
    assert total(halves) == total(columns) == on_device[name], "partitions do not add up"
    far = 2**31 + 12345
    assert device_sum(name, tensor[:1000], start=far) == tensor_sum(
        name, host[name][:1000], start=far
    )

    changes = {}
    after = {}
    for n, t in state.items():
        count = max(1, int(density * t.numel()))
        idx = torch.randperm(t.numel(), generator=gen, device=device)[:count].sort().values
        new = _random_bf16((count,), device, gen)
        old = t.reshape(-1)[idx]
        keep = new.view(torch.int16) != old.view(torch.int16)
        changes[n] = TensorChange(idx[keep], new[keep], old[keep])
        moved = t.clone()
        moved.view(-1)[idx[keep]] = new[keep]
        after[n] = moved
    changed = sum(c.indices.numel() for c in changes.values())
    updated, update_s = timed(device, lambda: apply_changes(on_device, changes))
    assert updated == {n: device_sum(n, t) for n, t in after.items()}, "update != recompute"
    return {
        "model": model,
        "elements": elements,
        "changed": changed,
        "density": changed / elements,
        "full_pass_s": full_s,
        "host_compiled_full_pass_s": host_s,
        "update_s": update_s,
        "checks": "ok",
    }


def table(result: dict) -> str:
    """A full pass on the device, the compiled loops on a host copy, and the O(changed) update."""
    return "\n".join(
        [
            "| pass | s |",
            "|---|---:|",
            f"| full digest on the device (int64 tensor ops) | {result['full_pass_s']:.2f} |",
            f"| the compiled loops on a host copy | {result['host_compiled_full_pass_s']:.2f} |",
            f"| O(changed) update from {result['changed'] / 1e6:.1f}M changed elements "
            f"({100 * result['density']:.1f} % density) | {result['update_s']:.2f} |",
        ]
    )


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-8b", choices=sorted(GPU_SHAPES))
    p.add_argument("--density", type=fraction, default=0.02)


def _run(args: argparse.Namespace, part, device: torch.device) -> bool:
    part.update(**run("qwen3-micro" if args.small else args.model, device, args.density))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_digest", __doc__, _run, argv, _options, table)


if __name__ == "__main__":
    sys.exit(main())
