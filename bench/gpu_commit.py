"""Part 3 of the GPU check: a replica's in-place commits of 1 / 3 / 10 % deltas, 8B stand-in,
with free device memory capped near 6 GB.

    PYTHONPATH=. python -m bench.gpu_commit --json commit.json        # cuda, Qwen3-8B stand-in
    PYTHONPATH=. python -m bench.gpu_commit --device cpu --small       # CI dry run

A vLLM-shaped stand-in of the Qwen3-8B shape (`bench.models.vllm_layout`: fused qkv /
gate_up, padded embedding, tied head; 15 GB bf16) holds random weights on the device, bound to an
`InPlaceSink` as by a first anchor. Each delta changes a random share of every tensor's
elements (the lowest mantissa bit flipped). The cap: `torch.cuda.set_per_process_memory_fraction`
leaves `--free-gb` (6) above what the stand-in holds, and the sink is told the same free figure
(`free_bytes=`, when its constructor takes it). Per delta:
- staging (outside the pause): the base values the decoder reads (only at the changed indices
  through the sink's `gather` when it has one, else whole host copies of touched tensors, as
  before) and the sink's own `stage`: bytes copied to the host and to the device;
- the commit (the pause): wall time, transient device peak, bytes uploaded, host waits, and an
  OOM or a refusal recorded instead of raised;
- afterwards: the changed elements hold the new values and every tensor's sum of bit patterns
  moved by exactly the changes (nothing else written), or, after a refusal, nothing moved.
Last, a commit with the sink's free-memory figure set below one chunk must be refused before
anything is written (when the sink takes `free_bytes=`).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Sequence

import torch

from deltasync.codec import DecodedFile, FileMetadata
from deltasync.kernels.changes import TensorChange
from deltasync.replica.sinks import StagedFile
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.wire.digests import StateDigest
from deltasync.wire.metadata import TensorEntry

from .gpu_common import Peak, Transfers, mib, part_main, shape_of, synchronize
from .models.qwen3 import build_config
from .models.vllm_layout import StandInQwen3, standin_layout
from .synthetic import parameter_shapes

__all__ = ["main"]

DENSITIES = (0.01, 0.03, 0.10)
RUN = "gpu-check"
GB = 1 << 30


def _meta(version: int, kind: str, shapes: dict, changes: dict | None = None) -> FileMetadata:
    changes = changes or {}
    entries = {
        n: TensorEntry(s, None, changes[n].indices.numel() if n in changes else 0)
        for n, s in shapes.items()
    }
    base = None if kind == "anchor" else version - 1
    return FileMetadata(RUN, version, base, kind, "ans", entries, state_digest=StateDigest.zero())


def _file(meta: FileMetadata, changes: dict | None = None) -> StagedFile:
    return StagedFile(meta, None, DecodedFile(meta, changes=changes or {}))


def _bit_sums(views: dict[str, torch.Tensor]) -> dict[str, int]:
    """Per tensor, the sum of its bf16 bit patterns (int64, on its device): any write shows."""
    return {n: int(v.view(torch.int16).sum(dtype=torch.int64)) for n, v in views.items()}


def _changes(views, density: float, gen: torch.Generator) -> dict[str, TensorChange]:
    """A delta of `density`: random flat indices per tensor, lowest mantissa bit flipped."""
    out = {}
    for name, view in views.items():
        flat = view.reshape(-1)
        index = (torch.rand(flat.shape, generator=gen, device=flat.device) < density).nonzero()
        index = index.squeeze(1)
        if index.numel() == 0:
            continue
        previous = flat[index]
        values = (previous.view(torch.int16) ^ 1).view(torch.bfloat16)
        out[name] = TensorChange(index.cpu(), values.cpu(), previous.cpu())
        del index, previous, values
    return out


def _staging(sink: InPlaceSink, files: list[StagedFile], changes: dict) -> tuple[object, dict]:
    """What staging copies: the decoder's base reads, then the sink's `stage`."""
    with Transfers() as moved:
        t0 = time.perf_counter()
        base = sink.tensors()
        gather = getattr(base, "gather", None)
        for name, change in changes.items():
            if gather is not None:
                gather(name, change.indices)
            else:
                base[name]  # the old staging: a whole host copy of every touched tensor
        staged = sink.stage(files)
        wall = time.perf_counter() - t0
    return staged, {
        "wall_s": wall,
        "base_reads": "gather at changed indices" if gather is not None else "whole tensors",
        **moved.figures(),
    }


def _commit(sink, files, staged, device) -> dict:
    error = None
    with Peak(device) as peak, Transfers() as moved:
        t0 = time.perf_counter()
        try:
            sink.commit(files, staged)
        except torch.cuda.OutOfMemoryError as exc:
            error = f"OOM: {exc}".splitlines()[0]
        except Exception as exc:  # a refusal (free memory short) or anything else
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        synchronize(device)
        wall = time.perf_counter() - t0
    return {
        "pause_s": wall,
        "transient_peak_bytes": peak.bytes,
        "oom": bool(error and error.startswith("OOM")),
        "error": error,
        **moved.figures(),
    }


def run(args, part, device: torch.device) -> bool:
    shape = shape_of("qwen3-micro" if args.small else "qwen3-8b", tied=True)
    config = build_config(shape)
    shapes = parameter_shapes(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad(), torch.device(device):
        standin = StandInQwen3(config)
        for param in standin.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen).mul_(0.02))
    served = sum(p.numel() for p in standin.parameters()) * 2
    layout = standin_layout(config)
    placements = layout(shapes).exact()
    params = dict(standin.named_parameters(remove_duplicate=False))
    views = {
        n: params[p.param_name].data.view(-1)[p.offset : p.offset + p.box.numel]
        for n, p in placements.items()
    }
    free = {"bytes": None}  # what the sink is told is free (None: the driver's figure)

    def free_bytes(dev: torch.device) -> int:
        if free["bytes"] is not None:
            return free["bytes"]
        if dev.type == "cuda":
            return max(0, cap - torch.cuda.memory_allocated(dev))
        return args.free_gb * GB

    takes_free = "free_bytes" in inspect.signature(InPlaceSink).parameters
    sink = InPlaceSink(standin, layout, **({"free_bytes": free_bytes} if takes_free else {}))
    part.update(
        shape={"name": "qwen3-micro" if args.small else "qwen3-8b (tied stand-in)"}
        | shape.__dict__,
        served_bytes=served,
        free_gb=args.free_gb,
        sink_takes_free_bytes=takes_free,
        chunk=getattr(sink, "chunk", None),
        deltas=[],
    )
    if not takes_free:
        part.skip("InPlaceSink has no free_bytes= argument: only the allocator cap applies")
    # Bind as a first anchor does; an anchor with no tensor data writes nothing (the stand-in
    # already holds its weights: uploading 15 GB again would only cost the check time).
    anchor = [_file(_meta(1, "anchor", shapes))]
    sink.commit(anchor, sink.stage(anchor))
    cap = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        cap = torch.cuda.memory_reserved(device) + args.free_gb * GB
        part.update(cap_bytes=cap, device_total_bytes=total)
    else:
        part.skip("no allocator cap on CPU: the sink is told --free-gb instead")
    ok = True
    rows = []
    for version, density in enumerate(DENSITIES, start=2):
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        changes = _changes(views, density, gen)
        before = _bit_sums(views)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        meta = _meta(version, "delta", shapes, changes)
        files = [_file(meta, changes)]
        changed = sum(c.indices.numel() for c in changes.values())
        row = {"target_density": density, "changed": changed, "density": changed / (served / 2)}
        staged, row["staging"] = _staging(sink, files, changes)
        row["commit"] = _commit(sink, files, staged, device)
        after = _bit_sums(views)
        if row["commit"]["error"] is None:
            moved = {
                n: before[n]
                + int(c.values.view(torch.int16).sum(dtype=torch.int64))
                - int(c.previous.view(torch.int16).sum(dtype=torch.int64))
                for n, c in changes.items()
            }
            row["only_changes_written"] = after == before | moved
            row["new_values_held"] = all(
                torch.equal(
                    views[n].reshape(-1)[c.indices.to(device)].view(torch.int16).cpu(),
                    c.values.view(torch.int16),
                )
                for n, c in changes.items()
            )
            ok &= row["only_changes_written"] and row["new_values_held"]
        else:  # refused or failed: nothing may have moved (the undo ran)
            row["unchanged_after_error"] = after == before
            ok &= row["unchanged_after_error"] and not row["commit"]["oom"]
        rows.append(row)
        part.update(deltas=rows)
        del changes, files, staged
    if takes_free:  # the sink told free memory below one chunk: refused, nothing written
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        changes = _changes(views, DENSITIES[0], gen)
        before = _bit_sums(views)
        files = [_file(_meta(len(DENSITIES) + 2, "delta", shapes, changes), changes)]
        free["bytes"] = 1024
        try:
            staged, _ = _staging(sink, files, changes)
            refused = _commit(sink, files, staged, device)
        finally:
            free["bytes"] = None
        refused["unchanged"] = _bit_sums(views) == before
        ok &= refused["error"] is not None and refused["unchanged"]
        part.update(refused_when_short=refused)
    return ok


def _options(p) -> None:
    p.add_argument("--free-gb", type=int, default=6, help="free device memory left (GB)")


def table(result: dict) -> str:
    """Each density's staging and commit."""
    lines = [
        "| density | changed | staging | staged to device | commit (the pause) | transient peak "
        "| OOM |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["deltas"]:
        staging, commit = row["staging"], row["commit"]
        lines.append(
            f"| {100 * row['target_density']:g} % | {row['changed'] / 1e6:.1f}M | "
            f"{staging['wall_s']:.2f} s | {staging['bytes_to_device'] / 1e9:.2f} GB | "
            f"{commit['pause_s']:.3f} s | {mib(commit['transient_peak_bytes'])} | "
            f"{'yes' if commit['oom'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_commit", __doc__, run, argv, _options, table)


if __name__ == "__main__":
    sys.exit(main())
