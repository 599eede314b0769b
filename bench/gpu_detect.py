"""Part 2 of the GPU check: the trainer's change detection on an 8B shape, device against host.

    PYTHONPATH=. python -m bench.gpu_detect --json detect.json        # cuda, Qwen3-8B shape
    PYTHONPATH=. python -m bench.gpu_detect --device cpu --small       # CI dry run (qwen3-micro)

fp32 master weights of the shape live on the device; each version negates a random `density`
share of every tensor's elements (a sign flip always changes the bf16 view), at 0.5 / 3 / 15 /
50 %, and `DeviceSnapshot.start_diff` finds them (the training thread's share; its returned
call, the publisher's worker's, copies them to the host: `worker`). Per density: wall time, host
waits and
`torch.cuda.synchronize` calls (counted by `gpu_common.Transfers`, no profiler), the transient
device peak (max allocated minus before), and bytes copied to and from the host. The host path
(`Bf16Snapshot.diff`: every parameter to the host as bf16, then the compiled scan) runs once, at
3 %, on the same weights: both diffs must be equal bit for bit, and its time against the device
times gives the crossover density (where device detection stops paying). The host mirror moves
with `advance` between versions, untimed, as the publisher's worker does.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence

import torch

from deltasync.arguments import count
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.snapshot import Bf16Snapshot

from .gpu_common import Peak, Transfers, mib, part_main, shape_of, synchronize
from .synthetic import parameter_shapes

__all__ = ["differing", "main"]

DENSITIES = (0.005, 0.03, 0.15, 0.5)
HOST_AT = 0.03  # the density the host path runs at once (its cost hardly depends on it)


def _perturb(params: dict[str, torch.Tensor], density: float, gen: torch.Generator) -> None:
    """Negate a random `density` share of every tensor's elements, in place on its device."""
    for tensor in params.values():
        flat = tensor.view(-1)
        sign = torch.rand(flat.shape, generator=gen, device=flat.device) < density
        flat.mul_(sign.to(flat.dtype).mul_(-2).add_(1))
        del sign


def differing(a, b) -> list[str]:
    """Names of tensors whose changes differ between two diffs (empty: equal bit for bit)."""
    bad = sorted(set(a.changes) ^ set(b.changes))
    for name in set(a.changes) & set(b.changes):
        x, y = a.changes[name], b.changes[name]
        if not torch.equal(x.indices.long(), y.indices.long()) or any(
            not torch.equal(getattr(x, f).view(torch.int16), getattr(y, f).view(torch.int16))
            for f in ("values", "previous")
        ):
            bad.append(name)
    return bad


def _measure(device: torch.device, fn, *args, **kwargs) -> tuple[object, dict]:
    with Peak(device) as peak, Transfers() as moved:
        synchronize(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        synchronize(device)
        wall = time.perf_counter() - t0
    return out, {"wall_s": wall, "transient_peak_bytes": peak.bytes, **moved.figures()}


def run(args, part, device: torch.device) -> bool:
    shape = shape_of("qwen3-micro" if args.small else "qwen3-8b", layers=args.layers)
    shapes = parameter_shapes(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        params = {
            n: torch.randn(s, generator=gen, device=device).mul_(0.02) for n, s in shapes.items()
        }
        elements = sum(t.numel() for t in params.values())
        part.update(
            shape={"name": "qwen3-micro" if args.small else "qwen3-8b", **shape.__dict__},
            elements=elements,
            fp32_device_bytes=4 * elements,
            densities=[],
        )
        mirror = Bf16Snapshot({n: t.to(torch.bfloat16).cpu() for n, t in params.items()})
        snapshot = DeviceSnapshot(mirror, device)
        first, load = _measure(device, snapshot.diff, params, digests=False)  # loads the reference
        assert not first.changes, "nothing changed yet, the device diff found changes"
        snapshot.advance(first)
        part.update(reference_load=load)
        ok = True
        rows = []
        for density in DENSITIES:
            _perturb(params, density, gen)
            finish, figures = _measure(device, snapshot.start_diff, params, digests=False)
            diff, worker = _measure(device, finish)  # the publisher's worker's share
            changed = diff.changed_elements
            row = {
                "target_density": density,
                "density": diff.density,
                "changed": changed,
                "device": figures,
                "worker": worker,
                "bytes_to_host_per_changed": (figures["bytes_to_host"] + worker["bytes_to_host"])
                / max(changed, 1),
            }
            ok &= abs(diff.density - density) < 0.1 * density + 1e-3
            if density == HOST_AT:
                want, host = _measure(device, snapshot.host.diff, params, digests=False)
                bad = differing(diff, want)
                ok &= not bad
                row["host"] = host
                row["host_equals_device"] = not bad
                row["differing_tensors"] = bad[:10]
                part.update(host_path=host | {"density": diff.density})
                del want
            rows.append(row)
            part.update(densities=rows)
            if density != DENSITIES[-1]:
                snapshot.advance(diff)
            del diff
    host_s = part.result["host_path"]["wall_s"]
    part.update(crossover_density=_crossover(rows, host_s), crossover_against_host_s=host_s)
    return ok


def _crossover(rows: list[dict], host_s: float) -> float | None:
    """The density where device detection gets as slow as the host path (linear between the
    measured densities); None when it stays faster up to the largest density measured."""
    points = [(r["density"], r["device"]["wall_s"]) for r in rows]
    if points[0][1] >= host_s:
        return points[0][0]
    for (d0, t0), (d1, t1) in itertools.pairwise(points):
        if t1 >= host_s:
            return d0 + (d1 - d0) * (host_s - t0) / (t1 - t0)
    return None


def _options(p) -> None:
    p.add_argument("--layers", type=count, default=None, help="cut the shape to N layers")


def table(result: dict) -> str:
    """Each density's device-mode diff, then the host path at its density (its bytes to the host
    are every parameter as bf16: the counter misses the pool threads' copies)."""
    lines = [
        "| density | changed | device mode: blocking | worker | to host | host waits "
        "| transient peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    changed = {}
    for row in result["densities"]:
        d, w = row["device"], row["worker"]
        changed[row["target_density"]] = row["changed"]
        lines.append(
            f"| {100 * row['target_density']:g} % | {row['changed'] / 1e6:.1f}M | "
            f"{d['wall_s']:.3f} s | {w['wall_s']:.3f} s | "
            f"{(d['bytes_to_host'] + w['bytes_to_host']) / 1e9:.2f} GB | "
            f"{d['host_waits'] + w['host_waits']} | "
            f"{mib(_larger(d['transient_peak_bytes'], w['transient_peak_bytes']))} |"
        )
    host = result.get("host_path")
    if host:
        at = min(changed, key=lambda t: abs(t - host["density"]))
        lines.append(
            f"| host path, {100 * at:g} % | {changed[at] / 1e6:.1f}M | {host['wall_s']:.2f} s | "
            f"- | {2 * result['elements'] / 1e9:.1f} GB | - "
            f"| {mib(host['transient_peak_bytes'])} |"
        )
    return "\n".join(lines)


def _larger(a: int | None, b: int | None) -> int | None:
    """The larger peak; None where neither was measured (on the CPU)."""
    return None if a is None and b is None else max(x for x in (a, b) if x is not None)


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_detect", __doc__, run, argv, _options, table)


if __name__ == "__main__":
    sys.exit(main())
