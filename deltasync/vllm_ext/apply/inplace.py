"""GPU apply path: a sink whose state is the served (fused) parameters themselves; no shadow.

Each checkpoint tensor is bound to the run of parameter elements vLLM's own loader fills with it
(`layout.Layout`: fused shards, stacked MoE experts, padded vocabularies, tied heads), in the
loader's layout, before any post-load transform: the unquantized GPU path keeps that layout.

Staging (while the model serves) reads the parameters only at a delta's changed indices:
`_HostCopies.gather`, which the decoder uses (`codec.files.Gathering`), selects them on their
device in bounded chunks and copies only those values to the host (O(changed) bytes per
version); whole host copies are made only where whole tensors are needed (a protocol 1 delta's
per-tensor digests, `Replica.digests`). `stage` keeps each delta's previous values on the host
(pinned on CUDA) as the undo data. `commit` (the pause, under `torch.inference_mode`) refuses,
writing nothing, when the device has less free memory than its largest chunk needs; it then
writes only the changed elements, at most `chunk` elements' indices and values on the device at
a time, undoing chunk by chunk what it wrote if anything fails, with one host sync at the end.
The digest is then read back from the parameters themselves. Under tensor parallelism
(`tp_rank`) each worker's sink holds its box of every tensor (rows or columns, as its loader
narrows them) in its own parameter shard.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from deltasync.errors import FormatError, ReloadError
from deltasync.kernels.boxes import Boxes, box_sums
from deltasync.kernels.state_hash import device_sum
from deltasync.replica.sinks import Shapes, StagedFile
from deltasync.vllm_ext.apply.layout import Layout
from deltasync.wire.digests import StateDigest

__all__ = ["CHUNK", "InPlaceSink"]

log = logging.getLogger(__name__)

CHUNK = 1 << 24  # elements per upload: 160 MiB on the device (int64 index + bf16 value each)


def _free_bytes(device: torch.device) -> int:
    """Free memory on `device` as the driver reports it (vLLM's KV cache is already taken);
    unlimited on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return sys.maxsize


class _HostCopies(Mapping[str, torch.Tensor]):
    """The parameters as host tensors for staging: whole copies made one at a time as they are
    asked for (each belongs to the caller, `fresh_copies`), or only the values at given indices
    (`gather`, what a delta's decoder reads). `count` is told every byte copied to the host."""

    fresh_copies = True

    def __init__(self, views: Mapping[str, torch.Tensor], chunk: int, count: Callable[[int], None]):
        self._views = views
        self._chunk = chunk
        self._count = count

    def __getitem__(self, name: str) -> torch.Tensor:
        copy = self._views[name].detach().to("cpu", copy=True).contiguous()
        self._count(copy.nbytes)
        return copy

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._views[name].shape)

    def held(self, name: str) -> tuple[torch.Tensor, list]:
        """The parameter's view on its device (a `ctx` delta ranks it there, chunk by chunk)."""
        return self._views[name].detach(), []

    def gather(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """A fresh host tensor of the parameter's values at flat `indices`, selected on its
        device one chunk at a time (at most `chunk` indices and values there at once)."""
        flat = self._views[name].detach().reshape(-1)
        out = torch.empty(indices.numel(), dtype=flat.dtype)
        for start in range(0, indices.numel(), self._chunk):
            part = slice(start, start + self._chunk)  # temporaries: freed chunk by chunk
            out[part].copy_(flat.index_select(0, indices[part].to(flat.device)))
        self._count(out.nbytes)
        return out


@dataclass(frozen=True)
class _Staged:
    """What `commit` writes with: the views (and boxes) bound, and per file the previous values
    of each changed tensor on the host (pinned on CUDA, so the undo uploads them directly)."""

    views: dict[str, torch.Tensor]
    boxes: Boxes | None
    undo: tuple[dict[str, torch.Tensor], ...]


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
        chunk: the most changed elements whose indices and values are on the device at once,
            in staging and in the commit.
        free_bytes: the free memory of a device (default: the driver's figure on CUDA,
            unlimited on the CPU); a commit whose largest chunk needs more is refused.
    """

    keeps_tensors = False  # writes changes in place; host copies are dropped once verified

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Callable[[Mapping[str, tuple[int, ...]]], Layout],
        *,
        tp_rank: int | None = None,
        chunk: int = CHUNK,
        free_bytes: Callable[[torch.device], int] | None = None,
    ):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model = model
        self.layout = layout
        self.tp_rank = tp_rank
        self.chunk = chunk
        self.free_bytes = free_bytes or _free_bytes
        self.host_bytes = 0  # what staging copied from the parameters to the host, in all
        self._counting = threading.Lock()  # the decoder gathers in a thread pool
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._views: dict[str, torch.Tensor] = {}
        self._boxes: Boxes | None = None

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """HF name -> the parameter elements holding it (shares storage with the model)."""
        return self._views

    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return next(iter(self._params.values())).device if self._params else torch.device("cpu")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._boxes is not None:
            return {n: self._boxes[n].shape for n in self._views}
        return {n: tuple(v.shape) for n, v in self._views.items()}

    def boxes(self, shapes: Shapes) -> Boxes | None:
        if self.tp_rank is None:
            return None
        return {n: p.box for n, p in self.layout(shapes).exact().items()}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return _HostCopies(self._views, self.chunk, self._count)

    def state_sums(self) -> dict[str, StateDigest]:
        """Digests of the served parameters themselves, with tensor ops on their device (no
        host copy; the same code on CPU, where the tests run it); the owned boxes' shares under
        tensor parallelism."""
        if self._boxes is not None:
            return box_sums(self._views, self._boxes)
        return {name: device_sum(name, view) for name, view in self._views.items()}

    def stage(self, files: Sequence[StagedFile]) -> _Staged:
        """Map an anchor's tensors onto the parameters (first anchor only; later ones have the
        replica's shape check) and keep each delta's previous values for the undo, pinned on
        CUDA now rather than in the pause."""
        views, boxes = self._views, self._boxes
        for file in files:
            if file.meta.kind == "anchor" and not views:
                shapes = {n: e.shape for n, e in file.meta.tensors.items()}
                views, boxes = self._bind(shapes, file.path), self.boxes(shapes)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        undo = tuple(
            {
                n: c.previous.pin_memory() if pin else c.previous
                for n, c in f.decoded.changes.items()
            }
            for f in files
        )
        return _Staged(views, boxes, undo)

    def commit(self, files: Sequence[StagedFile], staged: _Staged) -> None:
        """Write every file into the parameters; on an error the deltas written are undone.

        Runs under `torch.inference_mode`: vLLM creates its parameters in it, and an inference
        tensor may be written in place only there (a normal tensor may be too, untracked).

        Raises:
            ReloadError: the device has less free memory than the largest chunk needs; nothing
                was written and the previous version keeps serving.

        An anchor written earlier in the same update cannot be undone (its predecessor is kept
        nowhere): the sink then forgets its binding, which tells the replica it holds no known
        version, so the next update starts from an anchor.
        """
        self._check_memory(files)
        written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode():
            try:
                self._write(files, staged, written)
            except BaseException as exc:
                for flat, index, previous in reversed(written):
                    self._upload(flat, index, previous)
                _synchronize(self.device)
                if any(f.meta.kind == "anchor" for f in files):
                    log.error("update failed after an anchor was written in place: %s", exc)
                    self._views, self._boxes = {}, None
                raise
        self._views, self._boxes = staged.views, staged.boxes

    def _write(
        self,
        files: Sequence[StagedFile],
        staged: _Staged,
        written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """Anchors copied whole, deltas' changes in chunks; each delta tensor is listed in
        `written` before its first chunk, so a failure inside it is undone too."""
        for file, undo in zip(files, staged.undo, strict=True):
            if file.meta.kind == "anchor":
                written.clear()
                for name, tensor in file.decoded.tensors.items():
                    staged.views[name].copy_(tensor, non_blocking=False)
                continue
            for name, change in file.decoded.changes.items():
                flat = staged.views[name].view(-1)
                written.append((flat, change.indices, undo[name]))
                self._upload(flat, change.indices, change.values)
        _synchronize(self.device)

    def _upload(self, flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        """`flat[indices] = values` from host tensors, one chunk at a time. A chunk's index and
        values are temporaries of one statement: back to the caching allocator before the next
        chunk is uploaded, also when it raises (an undo then has the memory it checked)."""
        for start in range(0, indices.numel(), self.chunk):
            part = slice(start, start + self.chunk)
            flat.index_copy_(
                0,
                indices[part].to(flat.device, non_blocking=True),
                values[part].to(flat.device, non_blocking=True),
            )

    def _check_memory(self, files: Sequence[StagedFile]) -> None:
        """Refuse, before anything is written, a commit whose largest chunk does not fit in the
        device's free memory (an out-of-memory error in the pause would be undone, but the undo
        needs the same memory)."""
        need = max(
            (
                min(c.indices.numel(), self.chunk)
                * (c.indices.element_size() + c.values.element_size())
                for f in files
                for c in f.decoded.changes.values()
            ),
            default=0,
        )
        if not need:
            return
        free = self.free_bytes(self.device)
        if free < need:
            raise ReloadError(
                f"version {files[-1].meta.version} refused: a chunk of its changes needs "
                f"{need} bytes on {self.device}, {free} are free; nothing was written and the "
                "previous version keeps serving"
            )

    def _count(self, nbytes: int) -> None:
        with self._counting:
            self.host_bytes += nbytes

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


def _synchronize(device: torch.device) -> None:
    """The one host sync of a commit (and of its undo): the chunks' uploads are queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
