"""A box: the piece of a tensor a reader or writer holds, in the checkpoint's coordinates.

A trainer rank under FSDP2 holds a box of whole rows of every tensor (`publisher.shards`). A
worker of a TP-sharded model holds, of each HF tensor `[out, in]`, a box: a range of rows
(column-parallel linears, fused members, vocab shards) or a range of columns (row-parallel
linears), or all of it (norms, replicated on every worker). A worker that holds a box applies
only the changes inside it: a delta's global flat indices are mapped to the box's own row-major
indices (`localize`), and its share of the full-state digest is summed at the elements' global
indices, so the workers' shares add up to the version's digest. Elements held by several
workers (replicated norms, KV heads replicated when TP exceeds their count) count once: only the
box marked `owner` adds them. Pure torch and numpy: the boxes come from the serving engine
(`vllm_ext.apply.layout`, read off each worker's loaders), everything else here is tested
without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.errors import FormatError
from deltasync.kernels.changes import WORKERS, TensorChange
from deltasync.kernels.state_hash import indexed_sum, tensor_sum
from deltasync.wire.digests import StateDigest, total

__all__ = ["Box", "Boxes", "box_change_sums", "box_sums", "check_cover", "held_indices"]

_SUM_CHUNK = 1 << 22  # elements per digest task of a column box


@dataclass(frozen=True)
class Box:
    """Rows `[rows[0], rows[1])` and, for a 2-D tensor, columns `cols` (None: all) of a tensor
    of `shape`; `owner`: this worker counts these elements in the full-state digest."""

    shape: tuple[int, ...]
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    owner: bool = True

    def __post_init__(self) -> None:
        ok = 0 <= self.rows[0] <= self.rows[1] <= (self.shape[0] if self.shape else 1)
        if self.cols is not None:
            ok = ok and len(self.shape) == 2 and 0 <= self.cols[0] <= self.cols[1] <= self.shape[1]
        if not ok:
            raise FormatError(f"box rows {self.rows} cols {self.cols} do not fit {self.shape}")

    @classmethod
    def whole(cls, shape: tuple[int, ...], *, owner: bool = True) -> Box:
        return cls(tuple(shape), (0, shape[0] if shape else 1), None, owner)

    @property
    def shape_numel(self) -> int:
        """Elements of the whole tensor."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_numel(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def offset(self) -> int:
        """The global flat index of the box's first element (a box of whole rows)."""
        return self.rows[0] * self.row_numel

    @property
    def width(self) -> int:
        """Elements per row inside the box."""
        return self.row_numel if self.cols is None else self.cols[1] - self.cols[0]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return ()
        rows = self.rows[1] - self.rows[0]
        return (rows, *self.shape[1:]) if self.cols is None else (rows, self.width)

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * self.width

    @property
    def is_whole(self) -> bool:
        return self.rows == (0, self.shape[0] if self.shape else 1) and self.cols is None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The box of a tensor of `shape` (a view when it is whole rows)."""
        if not self.shape:
            return tensor
        out = tensor[self.rows[0] : self.rows[1]]
        return out if self.cols is None else out[:, self.cols[0] : self.cols[1]].contiguous()

    def clip(self, start: int, stop: int) -> Box:
        """This box seen from the box of rows `[start, stop)` (a trainer rank's part)."""
        r0 = min(max(self.rows[0], start), stop) - start
        r1 = min(max(self.rows[1], start), stop) - start
        return Box((stop - start, *self.shape[1:]), (r0, max(r0, r1)), self.cols, self.owner)

    def localize(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | slice]:
        """Ascending global flat indices -> (the box's flat indices of those inside it, which
        of them were kept: a slice or a mask over `indices`)."""
        lo, hi = self.rows[0] * self.row_numel, self.rows[1] * self.row_numel
        if self.cols is None:
            kept = slice(*np.searchsorted(indices, [lo, hi]).tolist())
            return indices[kept] - lo, kept
        row, col = np.divmod(indices, self.row_numel)
        mask = (row >= self.rows[0]) & (row < self.rows[1])
        mask &= (col >= self.cols[0]) & (col < self.cols[1])
        return (row[mask] - self.rows[0]) * self.width + (col[mask] - self.cols[0]), mask

    def globalize(self, local: torch.Tensor) -> torch.Tensor:
        """The box's flat indices -> the tensor's global flat indices (int64)."""
        local = local.to(torch.int64)
        if self.cols is None:
            return local + self.rows[0] * self.row_numel
        row, col = local // self.width, local % self.width
        return (row + self.rows[0]) * self.row_numel + col + self.cols[0]

    def to_json(self) -> list[int | None]:
        cols = self.cols or (None, None)
        return [self.rows[0], self.rows[1], cols[0], cols[1], int(self.owner)]


Boxes = Mapping[str, Box]


def held_indices(
    indices: np.ndarray, *, offset: int = 0, box: Box | None = None
) -> tuple[np.ndarray, np.ndarray | slice | None]:
    """A tensor's changes (ascending global flat indices) as the reader holds them, and which
    were kept: inside `box` at the box's flat indices (a tensor-parallel worker), or relative to
    the box of rows starting at flat `offset`, where every change must lie (a trainer rank)."""
    if box is not None:
        return box.localize(indices)
    if offset:
        if indices.size and indices[0] < offset:
            raise FormatError(f"indices before the box starting at {offset}")
        return indices - offset, None
    return indices, None


def box_sums(tensors: Mapping[str, torch.Tensor], boxes: Boxes) -> dict[str, StateDigest]:
    """Each owned box's share of its tensor's full-state digest (elements at their global
    indices), chunked over a small thread pool; boxes this worker does not own are left out."""
    tasks: list[tuple[str, torch.Tensor, int, torch.Tensor | None]] = []
    for name, tensor in tensors.items():
        box = boxes[name]
        if not box.owner:
            continue
        flat = tensor.reshape(-1)
        if box.cols is None or box.numel == 0:
            tasks.append((name, flat, box.rows[0] * box.row_numel, None))
            continue
        rows_per = max(1, _SUM_CHUNK // box.width)
        for start in range(0, box.rows[1] - box.rows[0], rows_per):
            chunk = flat[start * box.width : (start + rows_per) * box.width]
            index = torch.arange(start * box.width, start * box.width + chunk.numel())
            tasks.append((name, chunk, 0, box.globalize(index)))

    def run(task: tuple[str, torch.Tensor, int, torch.Tensor | None]) -> StateDigest:
        name, values, start, index = task
        if index is None:
            return tensor_sum(name, values, start=start)
        return indexed_sum(name, index.to(values.device), values)

    with ThreadPoolExecutor(WORKERS) as pool:
        parts = list(pool.map(run, tasks))
    out: dict[str, list[StateDigest]] = {n: [] for n in tensors if boxes[n].owner}
    for (name, *_), part in zip(tasks, parts, strict=True):
        out[name].append(part)
    return {name: total(found) for name, found in out.items()}


def box_change_sums(changes: Mapping[str, TensorChange], boxes: Boxes) -> dict[str, TensorChange]:
    """The owned boxes' changes at global indices: what moves this worker's share of the
    digest (`state_hash.apply_changes`)."""
    return {
        name: TensorChange(boxes[name].globalize(c.indices), c.values, c.previous)
        for name, c in changes.items()
        if boxes[name].owner
    }


def check_cover(boxes_by_worker: list[Boxes], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The workers' owned boxes tile every tensor exactly once (no element missed, none owned
    twice): their sizes add up to the tensor's and no two of them meet.

    Raises:
        FormatError: they do not, naming the tensor.
    """
    for name, shape in shapes.items():
        owned = [b[name] for b in boxes_by_worker if name in b and b[name].owner]
        numel = int(np.prod(shape, dtype=np.int64))
        meet = any(_meet(a, b) for i, a in enumerate(owned) for b in owned[i + 1 :])
        if meet or sum(b.numel for b in owned) != numel:
            raise FormatError("the workers' boxes do not cover it exactly once", tensor=name)


def _meet(a: Box, b: Box) -> bool:
    full = (0, a.shape[1]) if len(a.shape) == 2 else (0, 1)
    rows = min(a.rows[1], b.rows[1]) > max(a.rows[0], b.rows[0])
    ac, bc = a.cols or full, b.cols or full
    return rows and min(ac[1], bc[1]) > max(ac[0], bc[0])
