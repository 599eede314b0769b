"""Sharded trainers: every rank publishes its own rows of each parameter (FSDP2 `Shard(0)`).

FSDP2 (`torch.distributed.fsdp.fully_shard`) leaves each rank a box of contiguous rows of every
parameter (`DTensor.to_local()`); a box of rows of a row-major tensor is a contiguous range of flat
indices, so a rank diffs its box alone and writes its changes at global flat indices, with no
all-gather. The ranks of one version meet only to agree that every part is durable
(`ShardGroup`, a gloo group of the publisher threads' own), and rank 0 commits the manifest.
A rank that resumes a run of its own layout replays only its own part of each version
(`replay_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from deltasync.codec import ParsedFile, PartInfo, decode
from deltasync.errors import DigestMismatch, FormatError
from deltasync.kernels.boxes import Box, box_sums
from deltasync.kernels.changes import Diff, TensorChange, scatter
from deltasync.kernels.state_hash import apply_changes
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.snapshot import NamedTensors, named_items, named_tensors
from deltasync.replica.replay import replay
from deltasync.store import Store
from deltasync.wire.digests import StateDigest, total
from deltasync.wire.manifest import Manifest, fetch_file

__all__ = ["ShardGroup", "local_rows", "replay_rows", "to_global"]


def local_rows(
    source: NamedTensors, names: CheckpointNames | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """Each checkpoint tensor's local rows and their box in the full tensor; a plain tensor
    (every rank holds all of it) is a whole box this rank does not own alone (`owner=False`).

    A `DTensor` must be sharded on dim 0 over a 1-D mesh (what `fully_shard` makes); a plain
    tensor is all rows. Raises `FormatError` for any other placement (say which). With `names`,
    in-memory tensors are split into the checkpoint tensors they hold (`CheckpointNames.local`);
    a checkpoint tensor outside this rank's rows is an empty box.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: dict[str, torch.Tensor] = {}
    layout: dict[str, Box] = {}
    for name, tensor in named_items(source):
        shape = tuple(tensor.shape)
        if not isinstance(tensor, DTensor):
            plain = [(name, tensor)] if names is None else names.apply([(name, tensor)])
            for ckpt, view in plain:
                rows = view.shape[0] if view.dim() else 1
                local[ckpt], layout[ckpt] = view, Box(tuple(view.shape), (0, rows), owner=False)
            continue
        placements = tuple(tensor.placements)
        if placements != (Shard(0),) or not shape:
            raise FormatError(
                f"sharded publishing takes parameters sharded on dim 0 over a 1-D mesh "
                f"(FSDP2 fully_shard); found placements {placements}",
                tensor=name,
            )
        rows_here = tensor.to_local()
        rows, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        start, stop = offset[0], offset[0] + rows[0]
        if names is None or names.is_identity:
            # An empty box (torch.chunk leaves the last ranks none) starts where the rows end.
            local[name], layout[name] = rows_here, Box(shape, (start, stop))
            continue
        for ckpt, view, ckpt_shape, first, last in names.local(name, rows_here, start, stop, shape):
            if view is None:  # another rank's: an empty box where the ranks' rows meet
                view = rows_here.new_empty((0, *ckpt_shape[1:]))
            local[ckpt], layout[ckpt] = view, Box(tuple(ckpt_shape), (first, last))
    kept = dict(named_tensors(local))  # tied aliases share their local storage too
    return kept, {n: layout[n] for n in kept}


def to_global(diff: Diff, layout: Mapping[str, Box]) -> Diff:
    """A diff of this rank's boxes at the full tensors' flat indices and shapes (no digests: no rank
    holds a whole tensor)."""
    changes = {
        name: TensorChange(change.indices + layout[name].offset, change.values, change.previous)
        for name, change in diff.changes.items()
    }
    return Diff(changes, {}, {name: layout[name].shape for name in diff.shapes})


def part_info(rank: int, size: int, layout: Mapping[str, Box]) -> PartInfo:
    return PartInfo(rank, size, {n: b.rows for n, b in layout.items()})


def replay_rows(
    store: Store, manifest: Manifest, layout: Mapping[str, Box], rank: int, size: int
) -> tuple[dict[str, torch.Tensor], dict[str, StateDigest]] | None:
    """This rank's rows at the bucket's latest version, from its own part of each version only
    (no other rank's bytes, no whole tensor in memory); each part is checked against its share
    of the version's full-state digest.

    Returns None when the chain was not written by ranks of this layout (another rank count or
    other rows): the caller then replays the whole model.

    Raises:
        DigestMismatch: a part does not lead to the share of the digest it promises.
    """
    plan = manifest.plan(None, None)
    if any(e.parts is None or len(e.parts) != size for e in plan):
        return None
    rows = _RankRows(layout, rank)
    try:
        replay(store, plan, rows, fetch=lambda s, e: fetch_file(s, e.parts[rank]))  # type: ignore[index]
    except _OtherLayout:
        return None
    return rows.tensors, rows.sums


class _OtherLayout(Exception):
    """A part written by ranks of another layout."""


class _RankRows:
    """A replay's reader for one rank's part of each version (`replica.replay`)."""

    def __init__(self, layout: Mapping[str, Box], rank: int):
        self.layout, self.rank = layout, rank
        self.rows = {n: b.rows for n, b in layout.items()}
        self.shapes = {n: s.shape for n, s in layout.items()}
        self.offsets = {n: s.offset for n, s in layout.items()}
        self.tensors: dict[str, torch.Tensor] = {}
        self.sums: dict[str, StateDigest] = {}
        self.version: int | None = None

    def update(self, data: bytes, *, path: str | None = None) -> None:
        parsed = ParsedFile.parse(data, path=path)
        meta = parsed.meta
        if meta.part is None or meta.part.rows != self.rows:
            raise _OtherLayout
        if meta.kind == "delta" and meta.base_version != self.version:
            raise _OtherLayout
        if {n: e.shape for n, e in meta.tensors.items()} != self.shapes:
            raise _OtherLayout
        if meta.kind == "anchor":
            self.tensors = dict(decode(parsed).tensors)
            self.sums = box_sums(self.tensors, self.layout)
        else:
            changes = decode(parsed, base=self.tensors, offsets=self.offsets).changes
            moved = {
                n: TensorChange(c.indices + self.offsets[n], c.values, c.previous)
                for n, c in changes.items()
            }
            self.sums = apply_changes(self.sums, moved)
            for name, change in changes.items():
                scatter(self.tensors[name], change.indices, change.values)
        if (found := total(self.sums)) != meta.state_digest:
            message = f"part {self.rank} of version {meta.version} does not lead to its digest"
            raise DigestMismatch("", str(meta.state_digest), str(found), path=path, message=message)
        self.version = meta.version


class ShardGroup:
    """The trainer ranks that publish each version together.

    A gloo process group of its own (created collectively by every rank, in the same order as
    their other groups), so the publisher threads' collectives never interleave with the
    training loop's, on CPU or GPU (as `torch.distributed.checkpoint.async_save` does).

    Args:
        group: an existing process group to use instead of a new gloo group.
        timeout: how long a rank waits for the others at a version (a crashed rank: the
            version fails on the others once this passes, and is never committed).
    """

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=30)):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ShardGroup needs torch.distributed to be initialised")
        self._dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo", timeout=timeout)
        if dist.get_backend(self.group) != "gloo":  # object collectives from a worker thread
            raise ValueError("ShardGroup needs a gloo process group (the default makes one)")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (picklable objects)."""
        found: list[Any] = [None] * self.size
        self._dist.all_gather_object(found, value, group=self.group)
        return found

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        box = [value]
        self._dist.broadcast_object_list(
            box, src=self._dist.get_global_rank(self.group, 0), group=self.group
        )
        return box[0]
