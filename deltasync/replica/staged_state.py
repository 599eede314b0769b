"""The state a file is staged against: the sink's tensors with the files staged before it in the
same update applied, per tensor and only when asked (`Replica` decodes and verifies against it
while the sink's own tensors keep serving).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from deltasync.codec.files import Gathering
from deltasync.kernels.changes import TensorChange, bits, gather, scatter
from deltasync.replica.sinks import StagedFile

__all__ = ["GatheringStagedState", "StagedState", "staged_state"]


class StagedState(Mapping[str, torch.Tensor]):
    """The sink's tensors as the files staged so far leave them, made per tensor on access
    (nothing held is written)."""

    def __init__(self, base: Mapping[str, torch.Tensor], files: Sequence[StagedFile]):
        self._base = base
        self._files = files

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get_copy(name, private=False)

    def get_copy(self, name: str, *, private: bool) -> torch.Tensor:
        """The tensor; with `private`, one the caller may write (copied only when shared)."""
        anchors = [i for i, f in enumerate(self._files) if f.meta.kind == "anchor"]
        if anchors:
            start, owned = anchors[-1] + 1, False
            tensor = self._files[anchors[-1]].decoded.tensors.get(name)
        else:  # host copies of device tensors are made per access: the caller owns them
            start, owned = 0, getattr(self._base, "fresh_copies", False)
            tensor = self._base.get(name)
        if tensor is None:
            raise KeyError(name)
        for file in self._files[start:]:
            if name in file.updated:
                tensor, owned = file.updated[name], False
            elif name in file.decoded.changes:
                if not owned:
                    tensor, owned = tensor.clone(), True
                change = file.decoded.changes[name]
                scatter(tensor, change.indices, change.values)
        return tensor if owned or not private else tensor.clone()

    def __iter__(self) -> Iterator[str]:
        anchors = [f for f in self._files if f.meta.kind == "anchor"]
        return iter(anchors[-1].decoded.tensors if anchors else self._base)

    def __contains__(self, name: object) -> bool:  # without making the tensor
        anchors = [f for f in self._files if f.meta.kind == "anchor"]
        return name in (anchors[-1].decoded.tensors if anchors else self._base)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class GatheringStagedState(StagedState):
    """`StagedState` over a sink's tensors that gathers (`codec.files.Gathering`, a device
    sink's): a delta's decoder reads them only at its changed indices, with the deltas staged
    before it applied there, so staging copies O(changed) bytes to the host."""

    _base: Gathering

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._base.shape_of(name)

    def held(self, name: str) -> tuple[torch.Tensor, list[TensorChange]]:
        held, staged = self._base.held(name)
        for file in self._files:
            if name in file.updated:  # a whole tensor made on the host: that is the base now
                held, staged = file.updated[name], []
            elif name in file.decoded.changes:
                staged = [*staged, file.decoded.changes[name]]
        return held, staged

    def gather(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        values = self._base.gather(name, indices)
        for file in self._files:
            if name in file.updated:
                values = gather(file.updated[name], indices)
            elif name in file.decoded.changes:
                _overlay(values, indices, file.decoded.changes[name])
        return values


def staged_state(base: Mapping[str, torch.Tensor], files: Sequence[StagedFile]) -> StagedState:
    """The state a file decodes against: gathering from the sink's tensors where they offer it
    and no anchor staged before replaced them."""
    if isinstance(base, Gathering) and all(f.meta.kind == "delta" for f in files):
        return GatheringStagedState(base, files)
    return StagedState(base, files)


def _overlay(values: torch.Tensor, indices: torch.Tensor, change: TensorChange) -> None:
    """In place: `values[k] = change`'s value where `indices[k]` is one of its indices (both
    index lists strictly ascending)."""
    wanted, changed = indices.numpy(), change.indices.numpy()
    at = np.minimum(np.searchsorted(changed, wanted), max(changed.size - 1, 0))
    hit = changed[at] == wanted if changed.size else np.zeros(wanted.size, bool)
    bits(values)[hit] = bits(change.values)[at[hit]]
