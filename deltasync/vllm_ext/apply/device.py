"""GPU apply path: a sink whose state is the served (fused) parameters themselves; no shadow.

Each checkpoint tensor is bound to the run of parameter elements vLLM's own loader fills with it
(`layout.Layout`: fused shards, stacked MoE experts, padded vocabularies, tied heads), in the
loader's layout, before any post-load transform: the unquantized GPU path keeps that layout.
The `Replica` stages against host copies of the touched tensors (made one at a time while the
model serves) and verifies digests there; `commit` then writes only the changed elements into
the parameters (O(changed)), undoing what it wrote if anything fails, and the digest is then
read back from the parameters themselves. Under tensor parallelism (`tp_rank`) each worker's
sink holds its box of every tensor (rows or columns, as its loader narrows them) in its own
parameter shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Boxes, box_sums
from deltasync.kernels.state_hash import device_sum
from deltasync.replica.replica import Shapes, StagedFile
from deltasync.vllm_ext.apply.layout import Layout
from deltasync.wire.digests import StateDigest

__all__ = ["InPlaceSink"]

log = logging.getLogger(__name__)


class _HostCopies(Mapping[str, torch.Tensor]):
    """Host copies of device tensors, made one at a time as they are asked for; each belongs to
    the caller (`fresh_copies`), so the replica patches it without copying it again."""

    fresh_copies = True

    def __init__(self, views: Mapping[str, torch.Tensor]):
        self._views = views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name].detach().to("cpu", copy=True).contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


class InPlaceSink:
    """The replica state held in the model's own parameters (vLLM on CUDA, tensor parallel 1).

    Nothing is bound until the first anchor: its tensors are mapped onto their placements in
    `stage`, which refuses a file that does not fit (a tensor with no exact placement, named)
    before anything is written.

    Args:
        model: the vLLM model; parameters must be plain bf16 tensors (no quantization).
        layout: the served model's layout for checkpoint tensors of given shapes
            (`layout.LayoutOf`; under tensor parallelism this worker's boxes, with owners).
        tp_rank: this worker's tensor-parallel rank when the model is sharded over workers.
    """

    keeps_tensors = False  # writes changes in place; host copies are dropped once verified

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Callable[[Mapping[str, tuple[int, ...]]], Layout],
        *,
        tp_rank: int | None = None,
    ):
        self.model = model
        self.layout = layout
        self.tp_rank = tp_rank
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._views: dict[str, torch.Tensor] = {}
        self._boxes: Boxes | None = None

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """HF name -> the parameter elements holding it (shares storage with the model)."""
        return self._views

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._boxes is not None:
            return {n: self._boxes[n].shape for n in self._views}
        return {n: tuple(v.shape) for n, v in self._views.items()}

    def boxes(self, shapes: Shapes) -> Boxes | None:
        if self.tp_rank is None:
            return None
        return {n: p.box for n, p in self.layout(shapes).exact().items()}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return _HostCopies(self._views)

    def state_sums(self) -> dict[str, StateDigest]:
        """Digests of the served parameters themselves, with tensor ops on their device (no
        host copy; the same code on CPU, where the tests run it); the owned boxes' shares under
        tensor parallelism."""
        if self._boxes is not None:
            return box_sums(self._views, self._boxes)
        return {name: device_sum(name, view) for name, view in self._views.items()}

    def stage(self, files: Sequence[StagedFile]) -> tuple[dict[str, torch.Tensor], Boxes | None]:
        """Map an anchor's tensors onto the parameters (first anchor only; later ones have the
        replica's shape check); returns the views `commit` writes (and their boxes)."""
        views, boxes = self._views, self._boxes
        for file in files:
            if file.meta.kind == "anchor" and not views:
                shapes = {n: e.shape for n, e in file.meta.tensors.items()}
                views, boxes = self._bind(shapes, file.path), self.boxes(shapes)
        return views, boxes

    def commit(
        self,
        files: Sequence[StagedFile],
        staged: tuple[dict[str, torch.Tensor], Boxes | None],
    ) -> None:
        """Write every file into the parameters; on an error the deltas written are undone.

        An anchor written earlier in the same update cannot be undone (its predecessor is kept
        nowhere): the sink then forgets its binding, which tells the replica it holds no known
        version, so the next update starts from an anchor.
        """
        views, boxes = staged
        written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        try:
            for file in files:
                if file.meta.kind == "anchor":
                    written.clear()
                    for name, tensor in file.decoded.tensors.items():
                        views[name].copy_(tensor, non_blocking=False)
                    continue
                for name, change in file.decoded.changes.items():
                    flat = views[name].view(-1)
                    index = change.indices.to(flat.device, non_blocking=True)
                    flat.index_copy_(0, index, change.values.to(flat.device, non_blocking=True))
                    written.append((flat, index, change.previous))
            _synchronize(views)
        except BaseException as exc:
            for flat, index, previous in reversed(written):
                flat.index_copy_(0, index, previous.to(flat.device))
            _synchronize(views)
            if any(f.meta.kind == "anchor" for f in files):
                log.error("update failed after an anchor was written in place: %s", exc)
                self._views, self._boxes = {}, None
            raise
        self._views, self._boxes = views, boxes

    def _bind(self, shapes: Mapping[str, tuple[int, ...]], path: str | None) -> dict:
        """Each tensor's box (all of it at tensor parallel size 1) as the contiguous run of
        parameter elements vLLM's loader fills with it."""
        views = {}
        placements = self.layout(shapes).exact()
        for name in shapes:
            placement = placements[name]
            data = self._params[placement.param_name].data
            if data.dtype != torch.bfloat16 or not data.is_contiguous():
                raise FormatError(
                    f"in-place updates need contiguous bf16 parameters, found {data.dtype}",
                    tensor=name,
                    path=path,
                )
            run = data.view(-1)[placement.offset : placement.offset + placement.box.numel]
            views[name] = run.view(placement.box.local_shape)
        return views


def _synchronize(views: Mapping[str, torch.Tensor]) -> None:
    device = next(iter(views.values())).device if views else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
