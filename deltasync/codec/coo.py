"""The `coo` delta encoding: TRL PR #5417's `<name>.indices` int32 + `<name>.values` bf16."""

from __future__ import annotations

import math

import numpy as np
import torch

from deltasync.codec.registry import TensorToDecode, register_codec
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.kernels.changes import TensorChange, gather

__all__ = ["decode_tensor", "encode_changes"]

_INT32_MAX = 2**31 - 1


def encode_changes(
    changes: dict[str, TensorChange], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Ascending int32 flat indices and new absolute bf16 values per changed tensor."""
    out = {}
    for name, change in changes.items():
        numel = math.prod(shapes[name])
        if numel - 1 > _INT32_MAX:
            raise FormatError(
                "coo stores int32 indices; use encoding 'packed' for tensors past "
                f"2**31 elements ({numel})",
                tensor=name,
            )
        out[f"{name}.indices"] = change.indices.to(torch.int32)
        out[f"{name}.values"] = change.values.contiguous()
    return out


def decode_tensor(
    indices: torch.Tensor,
    values: torch.Tensor,
    base: torch.Tensor,
    *,
    offset: int = 0,
    box: Box | None = None,
) -> TensorChange:
    """Check a TRL-shaped pair against the base tensor (range, order, dtype) without mutating.

    With `offset`, `base` holds the tensor's elements from flat index `offset` on (a rank's
    box of rows); indices are returned relative to it. With `box`, `base` holds that box of the
    tensor and only the changes inside it are returned, at the box's flat indices."""
    if indices.dtype != torch.int32 or values.dtype != torch.bfloat16:
        raise FormatError(
            f"coo needs int32 indices and bf16 values, found {indices.dtype} and {values.dtype}"
        )
    if indices.dim() != 1 or values.shape != indices.shape:
        raise FormatError(
            f"coo indices {tuple(indices.shape)} and values {tuple(values.shape)} "
            "must be 1-D of one length"
        )
    numel = box.shape_numel if box is not None else base.numel()
    idx = indices.to(torch.int64) - offset
    if idx.numel():
        if int(idx[0]) < 0 or int(idx[-1]) >= numel:
            raise FormatError(f"indices out of range {offset}..{offset + numel - 1}")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise FormatError("indices are not strictly ascending")
    if box is not None:
        local, kept = box.localize(idx.numpy())
        idx = torch.from_numpy(np.ascontiguousarray(local))
        values = values[kept if isinstance(kept, slice) else torch.from_numpy(kept)]
    # values of the file's own bytes (a view, `codec.files`): the change gets its own copy
    return TensorChange(idx, values.clone(), gather(base, idx))


def _decode(one: TensorToDecode) -> TensorChange:
    indices, values = one.arrays
    if indices.numel() != one.changed:
        raise FormatError(f"{indices.numel()} changes, metadata says {one.changed}")
    return decode_tensor(indices, values, one.target, offset=one.offset, box=one.box)


register_codec(
    "coo",
    encode=lambda changes, shapes, base, rows: encode_changes(changes, shapes),
    decode=_decode,
    steps_from_base=False,  # the new values themselves
)
