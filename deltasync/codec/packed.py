"""The `packed` delta encoding: gap-coded indices and bit-pattern value differences under zstd.

Per changed tensor `<name>.gaps` and `<name>.vals`, LEB128 varints (`varint`) in one zstd frame
each (bucket_layout.md, "Delta, `encoding=packed`"). About 80 % of changed bf16 values move by
one step of their bit pattern, so most value codes are 1 or 2; values are only decodable against
the exact base version, which the chain guarantees.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltasync.codec.registry import TensorToDecode, register_codec
from deltasync.codec.varint import gap_varints, indices_from_gaps, step_varints, values_from_steps
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box, held_indices
from deltasync.kernels.changes import WORKERS, TensorChange

__all__ = ["decode_tensor", "encode_changes"]

ZSTD_LEVEL = 1  # level 3 is no smaller on these streams and ~1.7x slower
_GAP_BYTES_MAX = 10
_VAL_BYTES_MAX = 3


def _encode_one(item: tuple[str, TensorChange], level: int) -> list[tuple[str, np.ndarray]]:
    import zstandard  # only where `packed` files are met: `ans` needs no zstd

    name, change = item
    gaps = gap_varints(change.indices.numpy())
    steps = step_varints(
        change.values.view(torch.int16).numpy(), change.previous.view(torch.int16).numpy()
    )
    compressor = zstandard.ZstdCompressor(level=level)
    return [
        (f"{name}.gaps", np.frombuffer(compressor.compress(gaps), np.uint8)),
        (f"{name}.vals", np.frombuffer(compressor.compress(steps), np.uint8)),
    ]


def encode_changes(
    changes: dict[str, TensorChange], *, level: int = ZSTD_LEVEL, workers: int = WORKERS
) -> dict[str, torch.Tensor]:
    """The U8 payload tensors of a `packed` delta, compressed in a small thread pool."""
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(lambda item: _encode_one(item, level), changes.items())
        return {key: torch.from_numpy(arr.copy()) for pair in parts for key, arr in pair}


def _decompress(blob: torch.Tensor, max_bytes: int, what: str) -> np.ndarray:
    """zstd frame -> bytes, refusing frames that declare or produce more than `max_bytes`."""
    import zstandard

    raw = blob.numpy().tobytes()
    try:
        params = zstandard.get_frame_parameters(raw)
        if params.content_size > max_bytes:
            raise FormatError(f"{what} declares {params.content_size} bytes, at most {max_bytes}")
        out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=max_bytes)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what} is not a valid zstd frame: {exc}") from None
    if len(out) > max_bytes:
        raise FormatError(f"{what} decompresses to {len(out)} bytes, at most {max_bytes}")
    return np.frombuffer(out, np.uint8)


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

    With `offset`, `base` holds the tensor's elements from flat index `offset` on (a rank's
    box of rows); the changes must lie in it, and their indices are returned relative to it.
    With `box`, `base` holds that box of the tensor: every change is read and checked, and those
    inside the box are returned at the box's flat indices.
    """
    numel = box.shape_numel if box is not None else offset + base.numel()
    indices = indices_from_gaps(
        _decompress(gaps_blob, count * _GAP_BYTES_MAX, "gaps"), count, numel
    )
    indices, kept = held_indices(indices, offset=offset, box=box)
    previous, values = values_from_steps(
        _decompress(vals_blob, count * _VAL_BYTES_MAX, "vals"),
        base.detach().reshape(-1).view(torch.int16).numpy(),
        np.ascontiguousarray(indices),
        count=count,
        kept=kept,
    )
    return TensorChange(
        torch.from_numpy(np.ascontiguousarray(indices)),
        torch.from_numpy(values).view(torch.bfloat16),
        torch.from_numpy(previous).view(torch.bfloat16),
    )


def _decode(one: TensorToDecode) -> TensorChange:
    gaps, vals = one.arrays
    return decode_tensor(gaps, vals, one.changed, one.target, offset=one.offset, box=one.box)


register_codec(
    "packed", encode=lambda changes, shapes, base, rows: encode_changes(changes), decode=_decode
)
