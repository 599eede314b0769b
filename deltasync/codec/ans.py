"""The `ans` delta encoding: index gaps and bf16 value steps under a static rANS coder.

Per changed tensor two U8 tensors, each one `rans` integer stream:
- `<name>.gaps`: `index[i] - index[i-1] - 1` (index[-1] = -1), with `raw_bits` low bits raw, where
  `2**raw_bits` is about a quarter of the mean gap: the low bits of a geometric gap are close to
  uniform, the quotient above them is coded by its empirical distribution, so the stream costs
  about the entropy of the index set (log2 C(numel, changed));
- `<name>.vals`: `zigzag(int16(new_bits - base_bits)) - 1` (never negative: a changed value
  differs), no raw bits: the step distribution (80 % one step of the bit pattern) is coded at its
  empirical entropy, per tensor.
The tables travel in the streams (a few dozen bytes per tensor). Values are only decodable
against the exact base version, which the chain guarantees and the digests confirm.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..changes import WORKERS, TensorChange
from ..errors import FormatError
from ..slices import Box, held_indices
from .rans import decode_integers, encode_integers
from .varint import _apply_steps, _gaps_to_indices

__all__ = ["decode_tensor", "encode_changes", "gap_raw_bits"]


def gap_raw_bits(gaps: np.ndarray) -> int:
    """Raw low bits for gaps: `2**bits` near a quarter of the mean gap (0 for dense tensors)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    return max(0, min(40, int(np.log2(mean + 1.0)) - 2))


def _encode_one(item: tuple[str, TensorChange]) -> list[tuple[str, np.ndarray]]:
    name, change = item
    indices = change.indices.numpy()
    gaps = np.diff(indices, prepend=-1) - 1
    step = (
        change.values.view(torch.int16).numpy().astype(np.int32)
        - change.previous.view(torch.int16).numpy()
    ).astype(np.int16)  # wraps modulo 2**16
    step = step.astype(np.int64)
    codes = ((step << 1) ^ (step >> 15)) - 1
    return [
        (f"{name}.gaps", np.frombuffer(encode_integers(gaps, gap_raw_bits(gaps)), np.uint8)),
        (f"{name}.vals", np.frombuffer(encode_integers(codes, 0), np.uint8)),
    ]


def encode_changes(
    changes: dict[str, TensorChange], *, workers: int = WORKERS
) -> dict[str, torch.Tensor]:
    """The U8 payload tensors of an `ans` delta, encoded in a small thread pool."""
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(_encode_one, changes.items())
        return {key: torch.from_numpy(arr.copy()) for pair in parts for key, arr in pair}


def decode_tensor(
    gaps_blob: torch.Tensor,
    vals_blob: torch.Tensor,
    count: int,
    base: torch.Tensor,
    *,
    offset: int = 0,
    box: Box | None = None,
) -> TensorChange:
    """Decode one tensor's changes against its base values (validated, nothing mutated).

    `offset` and `box` as in `packed.decode_tensor`: a rank's row block from flat index
    `offset` on, or a tensor-parallel worker's box of the tensor.
    """
    numel = box.shape_numel if box is not None else offset + base.numel()
    indices = decode_integers(gaps_blob.numpy(), count, "gaps")
    if not _gaps_to_indices(indices, numel):  # each gap < 2**57: no overflow
        raise FormatError(f"indices run past the tensor's {numel} elements")
    indices, kept = held_indices(indices, offset=offset, box=box)
    codes = decode_integers(vals_blob.numpy(), count, "vals")
    if count and int(codes.max()) >= (1 << 16) - 1:
        raise FormatError("a value step is out of range")
    codes += 1
    if kept is not None:
        codes = np.ascontiguousarray(codes[kept])
    indices = np.ascontiguousarray(indices)
    previous = np.empty(indices.size, np.int16)
    values = np.empty(indices.size, np.int16)
    _apply_steps(
        codes, base.detach().reshape(-1).view(torch.int16).numpy(), indices, previous, values
    )
    return TensorChange(
        torch.from_numpy(indices),
        torch.from_numpy(values).view(torch.bfloat16),
        torch.from_numpy(previous).view(torch.bfloat16),
    )
