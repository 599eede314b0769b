"""The names and shapes a model's tensors have in its checkpoint on disk, as views of memory.

transformers 5 may hold tensors in memory under other names and shapes than its checkpoints
use: a Mixture-of-Experts layer keeps all experts fused in one 3-D tensor
(`mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden]) that `save_pretrained` writes as
one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`). The wire carries the
checkpoint's names, so an anchor is a plain checkpoint that transformers and vLLM load as is.

The conversion is transformers' own (`revert_weight_conversion`, what `save_pretrained` runs),
traced once per model: each in-memory tensor is filled with its element indices and converted,
and every checkpoint tensor it yields must be a strided view of that tensor's elements (an
offset and strides). Each version is then converted with `as_strided` views, no copy and no
transformers call; a trainer rank holding some rows of a tensor (FSDP2) holds the checkpoint
tensors that lie in those rows. A conversion that is not a strided view (one that mixes
tensors or computes values) is refused when traced, naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import FormatError

__all__ = ["CheckpointNames", "CheckpointView"]


@dataclass(frozen=True)
class CheckpointView:
    """Checkpoint tensor `name` is `as_strided(shape, stride, offset)` of in-memory `source`."""

    name: str
    source: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        return tensor.as_strided(self.shape, self.stride, tensor.storage_offset() + self.offset)

    def flat_range(self) -> tuple[int, int]:
        """The smallest and one past the largest flat index of the source it reads."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.offset, self.offset + last + 1


class CheckpointNames:
    """In-memory parameter name -> the checkpoint tensors it holds (identity for most models).

    Build with `CheckpointNames.of(model)` for a transformers model; `CheckpointNames({})` is
    the identity (any other source of named tensors).
    """

    def __init__(self, views: Mapping[str, list[CheckpointView]]):
        self.views = dict(views)

    @property
    def is_identity(self) -> bool:
        return not self.views

    @classmethod
    def of(cls, model: torch.nn.Module) -> CheckpointNames:
        """Trace `model`'s save-time conversion (identity for models that have none).

        Raises:
            FormatError: a checkpoint tensor is not a strided view of one in-memory tensor.
        """
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # no transformers: names are what the caller gives
            return cls({})
        if not hasattr(model, "config"):
            return cls({})
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        views: dict[str, list[CheckpointView]] = {}
        for name, shape in shapes.items():
            probe = {name: torch.empty(shape, device="meta")}
            out = revert_weight_conversion(model, probe)
            if list(out) == [name] and tuple(out[name].shape) == shape:
                continue  # kept as is
            views[name] = _trace(model, name, shape, revert_weight_conversion)
        return cls(views)

    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint-named tensors (views) for in-memory-named ones."""
        out = []
        for name, tensor in named:
            views = self.views.get(name)
            if views is None:
                out.append((name, tensor))
            else:
                out.extend((v.name, v.of(tensor)) for v in views)
        return sorted(out, key=lambda item: item[0]) if self.views else out

    def local(self, name: str, tensor: torch.Tensor, start: int, stop: int, shape: tuple[int, ...]):
        """The checkpoint tensors of rows `[start, stop)` of in-memory `name` (full `shape`) that
        a trainer rank holds as `tensor`: `[(ckpt name, local view, ckpt shape, first row,
        last row)]`. A checkpoint tensor must lie wholly inside or outside the rows; one
        outside has no view and an empty row range at its start (the rows are a later rank's)
        or end (an earlier rank's), so the ranks' ranges tile it in rank order.

        Raises:
            FormatError: the rows cut a checkpoint tensor elsewhere.
        """
        views = self.views.get(name)
        if views is None:
            return [(name, tensor, shape, start, stop)]
        row = math.prod(shape[1:])
        lo, hi = start * row, stop * row
        out = []
        for view in views:
            first, last = view.flat_range()
            if last <= lo or first >= hi:  # another rank's: empty, where the ranks' rows meet
                at = (view.shape[0] if view.shape else 1) if last <= lo else 0
                out.append((view.name, None, view.shape, at, at))
                continue
            if first < lo or last > hi:
                raise FormatError(
                    f"the trainer's shard of {name} (rows {start}..{stop}) cuts checkpoint tensor "
                    f"{view.name}; shard on whole experts",
                    tensor=name,
                )
            local = tensor.as_strided(view.shape, view.stride, tensor.storage_offset() + first - lo)
            out.append((view.name, local, view.shape, 0, view.shape[0] if view.shape else 1))
        return out


def _trace(
    model: torch.nn.Module, name: str, shape: tuple[int, ...], revert
) -> list[CheckpointView]:
    """Convert a tensor of element indices; each output must be a strided view of them."""
    numel = math.prod(shape)
    dtype = torch.int32 if numel < 2**31 else torch.int64
    codes = torch.arange(numel, dtype=dtype).view(shape)
    views = []
    for target, out in revert(model, {name: codes}).items():
        out = out[0] if isinstance(out, list) else out
        if out.dtype != dtype or out.numel() == 0:
            raise FormatError("its checkpoint conversion changes values", tensor=target)
        first = int(out.reshape(-1)[0])
        stride = tuple(
            int(out[tuple(1 if d == j else 0 for d in range(out.dim()))]) - first
            if out.shape[j] > 1
            else 1
            for j in range(out.dim())
        )
        view = CheckpointView(target, name, tuple(out.shape), stride, first)
        if min(stride, default=1) < 0 or not torch.equal(view.of(codes.view(-1)), out):
            raise FormatError(
                f"its checkpoint tensor is not a strided view of in-memory {name}; "
                "publishing this model needs a conversion deltasync does not trace",
                tensor=target,
            )
        views.append(view)
    return views
