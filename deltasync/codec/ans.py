"""The `ans` delta encoding: index gaps and bf16 value steps under a static rANS coder.

Per changed tensor two U8 tensors, each one `rans` integer stream (bucket_layout.md, "Delta,
`encoding=ans`"): `<name>.gaps` holds the index gaps, their low bits raw (`gap_raw_bits`), at
about the entropy of the index set (log2 C(numel, changed)); `<name>.vals` holds the bf16
bit-pattern steps (80 % of them one step) at their empirical entropy, per tensor.
The tables travel in the streams (a few dozen bytes per tensor). Values are only decodable
against the exact base version, which the chain guarantees and the digests confirm.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltasync.codec.rans import decode_gaps, decode_integers, encode_gaps, encode_integers
from deltasync.codec.registry import TensorToDecode, register_codec
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box, held_indices
from deltasync.kernels.changes import WORKERS, TensorChange
from deltasync.kernels.jit import compiled

__all__ = ["decode_tensor", "encode_changes", "gap_raw_bits", "raw_bits_for"]


def gap_raw_bits(indices: np.ndarray) -> int:
    """Raw low bits for the gaps of ascending `indices`: `2**bits` near a quarter of the mean
    gap (0 for dense tensors)."""
    if indices.size == 0:
        return 0
    return raw_bits_for((int(indices[-1]) + 1) / indices.size - 1)  # gaps sum to last + 1 - size


def raw_bits_for(mean_gap: float) -> int:
    """Raw low bits for gaps of mean `mean_gap`: `2**bits` near a quarter of it."""
    return max(0, min(40, int(np.log2(mean_gap + 1.0)) - 2))


@compiled
def _step_codes(new_bits, old_bits, codes):  # pragma: no cover - compiled
    """zigzag(int16(new - old)) - 1 of each changed value (never negative: a changed value
    differs from its base)."""
    for i in range(new_bits.size):
        step = np.int16(np.int64(new_bits[i]) - np.int64(old_bits[i]))  # wraps modulo 2**16
        codes[i] = ((np.int64(step) << 1) ^ (np.int64(step) >> 15)) - 1


@compiled
def _apply_codes(codes, base, indices, previous, values):  # pragma: no cover - compiled
    """previous = base[indices]; values = previous + unzigzag(codes + 1) modulo 2**16; False
    when a code is out of range (a value step of 0 or past 16 bits)."""
    for k in range(codes.size):
        code = codes[k] + 1
        if code >= 1 << 16:
            return False
        old = base[indices[k]]
        previous[k] = old
        values[k] = np.int16(np.int64(old) + ((code >> 1) ^ -(code & 1)))
    return True


def _codes(change: TensorChange) -> np.ndarray:
    codes = np.empty(change.values.numel(), np.uint16)
    new_bits, old_bits = (t.view(torch.int16).numpy() for t in (change.values, change.previous))
    _step_codes(new_bits, old_bits, codes)
    return codes


def _encode_stream(change: TensorChange, kind: str) -> np.ndarray:
    if kind == "vals":
        return encode_integers(_codes(change), 0)
    indices = change.indices.numpy()
    return encode_gaps(indices, gap_raw_bits(indices))


def encode_changes(
    changes: dict[str, TensorChange], *, workers: int = WORKERS
) -> dict[str, torch.Tensor]:
    """The U8 payload tensors of an `ans` delta; every stream is one task of a small thread
    pool (the compiled coder releases the GIL), so a large tensor's two streams run at once."""
    jobs = [(name, kind) for name in changes for kind in ("gaps", "vals")]
    with ThreadPoolExecutor(workers) as pool:
        streams = pool.map(lambda job: _encode_stream(changes[job[0]], job[1]), jobs)
        return {
            f"{name}.{kind}": torch.from_numpy(data)
            for (name, kind), data in zip(jobs, streams, strict=True)
        }


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

    `offset` and `box` as in `packed.decode_tensor`: a rank's box of rows from flat index
    `offset` on, or a tensor-parallel worker's box of the tensor.
    """
    numel = box.shape_numel if box is not None else offset + base.numel()
    indices = decode_gaps(gaps_blob.numpy(), count, numel, "gaps")
    indices, kept = held_indices(indices, offset=offset, box=box)
    codes = decode_integers(vals_blob.numpy(), count, "vals")
    if kept is not None:
        codes = np.ascontiguousarray(codes[kept])
    indices = np.ascontiguousarray(indices)
    previous = np.empty(indices.size, np.int16)
    values = np.empty(indices.size, np.int16)
    base_bits = base.detach().reshape(-1).view(torch.int16).numpy()
    if not _apply_codes(codes, base_bits, indices, previous, values):
        raise FormatError("a value step is out of range")
    return TensorChange(
        torch.from_numpy(indices),
        torch.from_numpy(values).view(torch.bfloat16),
        torch.from_numpy(previous).view(torch.bfloat16),
    )


def _decode(one: TensorToDecode) -> TensorChange:
    gaps, vals = one.arrays
    return decode_tensor(gaps, vals, one.changed, one.target, offset=one.offset, box=one.box)


register_codec(
    "ans", encode=lambda changes, shapes, base, rows: encode_changes(changes), decode=_decode
)
