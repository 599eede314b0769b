"""Part 5 of the GPU check: special fp32 values to bf16 on the CPU against the device.

    PYTHONPATH=. python -m bench.gpu_special --json special.json      # cuda
    PYTHONPATH=. python -m bench.gpu_special --device cpu --small     # CI dry run (CPU vs CPU)

+-0, +-inf, NaNs (both signs, quiet and signalling payloads), subnormals, the largest finite
values and rounding ties go through the project's conversion (`snapshot.to_bf16` when it exists,
else `Tensor.to(torch.bfloat16)`) on the host and on `--device`, and through the two change
detections' own paths (`bf16_view`, the host path; `to_bf16` on the device, the device path).
Bit patterns are compared: `mismatches` lists every value whose bf16 bits differ between host
and device, `not_round_to_nearest_even` every non-NaN value that differs from round to nearest,
ties to even (computed here with integers), `nan_lost` every NaN that did not stay a NaN.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from deltasync.publisher import snapshot

from .gpu_common import part_main

__all__ = ["main"]

VALUES = {  # name -> fp32 bit pattern
    "+0": 0x00000000,
    "-0": 0x80000000,
    "+inf": 0x7F800000,
    "-inf": 0xFF800000,
    "+nan quiet": 0x7FC00000,
    "-nan quiet": 0xFFC00000,
    "+nan signalling payload 1": 0x7F800001,
    "-nan signalling payload 1": 0xFF800001,
    "+nan payload high": 0x7FBFFFFF,
    "+nan payload low bits only": 0x7F80FFFF,
    "-nan all ones": 0xFFFFFFFF,
    "+nan quiet payload": 0x7FC12345,
    "smallest subnormal": 0x00000001,
    "-smallest subnormal": 0x80000001,
    "largest subnormal": 0x007FFFFF,
    "subnormal tie to even (down)": 0x00008000,
    "subnormal tie to even (up)": 0x00018000,
    "smallest normal": 0x00800000,
    "1 + tie (down to even)": 0x3F808000,
    "1 + tie (up to even)": 0x3F818000,
    "1 + just above tie": 0x3F808001,
    "1 + just below tie": 0x3F807FFF,
    "-1 + tie": 0xBF808000,
    "largest finite (rounds to inf)": 0x7F7FFFFF,
    "largest bf16 + tie (to inf)": 0x7F7F8000,
    "largest bf16 + below tie": 0x7F7F7FFF,
    "-largest finite": 0xFF7FFFFF,
    "1.0": 0x3F800000,
    "pi": 0x40490FDB,
}


def _rne(bits: int) -> int:
    """bf16 bits of fp32 `bits`, round to nearest, ties to even (non-NaN inputs)."""
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _is_nan16(bits: int) -> bool:
    return (bits & 0x7F80) == 0x7F80 and (bits & 0x007F) != 0


def run(args, part, device: torch.device) -> bool:
    names = list(VALUES)
    raw = np.array([VALUES[n] for n in names], dtype=np.uint32)
    host = torch.from_numpy(raw.view(np.float32).copy())
    on_device = host.to(device)
    convert = getattr(snapshot, "to_bf16", None)
    part.update(
        conversion="deltasync.publisher.snapshot.to_bf16" if convert else "Tensor.to(bfloat16)"
    )
    if convert is None:

        def convert(t):
            return t.to(torch.bfloat16)

    def bits(t: torch.Tensor) -> list[int]:
        return [b & 0xFFFF for b in t.detach().cpu().view(torch.int16).tolist()]

    paths = {
        "host": bits(convert(host)),
        "device": bits(convert(on_device)),
        "torch_cpu": bits(host.to(torch.bfloat16)),
        "torch_device": bits(on_device.to(torch.bfloat16)),
        "host_detection": bits(snapshot.bf16_view(on_device)),  # the host path's copy
    }
    rows, mismatches, not_rne, nan_lost = [], [], [], []
    for i, name in enumerate(names):
        fp32 = int(raw[i])
        row = {"name": name, "fp32": f"0x{fp32:08X}"}
        row |= {k: f"0x{v[i]:04X}" for k, v in paths.items()}
        is_nan = (fp32 & 0x7F800000) == 0x7F800000 and (fp32 & 0x7FFFFF) != 0
        want = None if is_nan else _rne(fp32)
        row["round_to_nearest_even"] = None if want is None else f"0x{want:04X}"
        rows.append(row)
        if len({paths["host"][i], paths["device"][i], paths["host_detection"][i]}) > 1:
            mismatches.append(row)
        if want is not None and any(paths[k][i] != want for k in ("host", "device")):
            not_rne.append(row)
        if is_nan and not all(_is_nan16(paths[k][i]) for k in ("host", "device")):
            nan_lost.append(row)
    torch_differs = [r["name"] for r in rows if r["torch_cpu"] != r["torch_device"]]
    part.update(
        values=rows,
        mismatches=mismatches,
        not_round_to_nearest_even=not_rne,
        nan_lost=nan_lost,
        torch_cpu_vs_device_differs=torch_differs,  # torch's own conversion, for the record
    )
    if device.type == "cpu":
        part.skip("CPU against CPU: the device side is the same kernel (a dry run only)")
    return not mismatches and not not_rne and not nan_lost


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_special", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
