"""GPU apply path: the served (fused) parameters are the replica state; no CPU shadow.

Staging decodes a file against the parameters and, with `verify`, checks each touched tensor's
post-update digest on a host copy, all while the model keeps serving. Applying then writes only
the changed elements into the parameters (O(changed)); a failed multi-version update is undone
from the `previous` values the deltas carry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..codec import decode
from ..codec.header import parse_header_bytes
from ..codec.metadata import FileMetadata
from ..digest import tensor_digest
from ..errors import ChainError, DigestMismatch, FormatError
from ..replica import StagedUpdate
from .layout import build_layout, slot_view

__all__ = ["InPlacePrepared", "InPlaceReplica"]

log = logging.getLogger(__name__)


class _HostCopies(Mapping[str, torch.Tensor]):
    """Read-only host copies of device tensors, made one at a time when the decoder asks."""

    def __init__(self, views: Mapping[str, torch.Tensor]):
        self._views = views

    def __getitem__(self, name: str) -> torch.Tensor:
        return _host_copy(self._views[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


@dataclass(frozen=True)
class InPlacePrepared:
    """Files of one update with the first one staged (later ones decode against the first)."""

    files: list[tuple[bytes, str | None]]
    first: StagedUpdate | None


class InPlaceReplica:
    """Replica state held in the model's own parameters (vLLM on CUDA, tensor parallel 1).

    Args:
        model: the vLLM model; parameters must be plain bf16 tensors (no quantization).
        verify: check digests of touched tensors before writing (one device-to-host copy each).
        allow_legacy: accept TRL v1 files without run, base version or digests.
    """

    def __init__(self, model: torch.nn.Module, *, verify: bool = True, allow_legacy: bool = False):
        self.model = model
        self.verify = verify
        self.allow_legacy = allow_legacy
        self.run_id: str | None = None
        self.version: int | None = None
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._views: dict[str, torch.Tensor] = {}

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """HF name -> the parameter rows holding it (shares storage with the model)."""
        return self._views

    def _bind(self, shapes: Mapping[str, tuple[int, ...]], path: str | None) -> None:
        """Map the file's tensors onto parameters (once; later files must name the same set)."""
        if self._views:
            if set(shapes) != set(self._views):
                diff = sorted(set(shapes) ^ set(self._views))[:5]
                raise FormatError(
                    f"file names other tensors than the served model: {diff}", path=path
                )
            return
        views = {}
        for name, slot in build_layout(self.model, shapes).items():
            view = slot_view(self._params, slot)
            if view.dtype != torch.bfloat16 or not view.is_contiguous():
                raise FormatError(
                    f"in-place updates need contiguous bf16 parameters, found {view.dtype}",
                    tensor=name,
                )
            views[name] = view.view(shapes[name]) if view.dim() else view
        self._views = views

    def stage(self, data: bytes, *, path: str | None = None) -> StagedUpdate:
        """Decode and validate `data` against the served parameters without changing them."""
        meta = FileMetadata.from_strings(parse_header_bytes(data, path=path).metadata, path=path)
        if meta.legacy and not self.allow_legacy:
            raise FormatError("TRL v1 file without run id or digests refused", path=path)
        if not meta.legacy and meta.run_id == self.run_id and meta.version == self.version:
            return StagedUpdate(meta, path, noop=True)
        if meta.kind == "delta":
            self._check_chain(meta, path)
        if meta.tensors:
            self._bind({n: e.shape for n, e in meta.tensors.items()}, path)
        decoded = decode(data, base=_HostCopies(self._views), path=path)
        if meta.kind == "anchor":
            if not self._views:
                self._bind({n: tuple(t.shape) for n, t in decoded.tensors.items()}, path)
            for name, tensor in decoded.tensors.items():
                view = self._views.get(name)
                if view is None or view.shape != tensor.shape:
                    raise FormatError("anchor tensor does not fit the served model", tensor=name)
                entry = meta.tensors.get(name)
                if entry is not None and tensor_digest(tensor) != entry.digest:
                    raise DigestMismatch(name, entry.digest or "", tensor_digest(tensor), path=path)
        elif self.verify and not meta.legacy:
            for name, change in decoded.changes.items():
                host = _host_copy(self._views[name])
                host.view(-1)[change.indices] = change.values
                found = tensor_digest(host)
                if found != meta.tensors[name].digest:
                    raise DigestMismatch(name, meta.tensors[name].digest or "", found, path=path)
        return StagedUpdate(meta, path, decoded)

    def apply(self, staged: StagedUpdate) -> bool:
        """Write a staged file into the parameters; False for a duplicate."""
        if staged.noop:
            return False
        assert staged.decoded is not None
        meta = staged.meta
        if meta.kind == "anchor":
            for name, tensor in staged.decoded.tensors.items():
                self._views[name].copy_(tensor, non_blocking=False)
        else:
            self._check_chain(meta, staged.path)
            self._write(staged, previous=False)
        _synchronize(self._views)
        if not meta.legacy:
            self.run_id = meta.run_id
        self.version = meta.version
        return True

    def prepare(self, files: Sequence[tuple[bytes, str | None]]) -> InPlacePrepared:
        """Stage the first file while serving (a chain's later files stage in `commit`)."""
        first = self.stage(files[0][0], path=files[0][1]) if files else None
        return InPlacePrepared(list(files), first)

    def commit(self, prepared: InPlacePrepared) -> list[int]:
        """Write the update (the pause): O(changed elements) per delta."""
        steps: list[Callable[[], StagedUpdate]] = []
        for i, (data, path) in enumerate(prepared.files):
            if i == 0 and prepared.first is not None:
                steps.append(lambda staged=prepared.first: staged)
            else:
                steps.append(lambda d=data, p=path: self.stage(d, path=p))
        return self.apply_all(steps)

    def apply_all(self, steps: Iterable[Callable[[], StagedUpdate]]) -> list[int]:
        """Stage (validate) and write each step in turn; returns the versions applied.

        On an error the deltas already written are undone, newest first, so the model serves the
        version it served before (an anchor written earlier in the same update stays: its
        predecessor is not kept anywhere, and the error says which version is served).
        """
        done: list[tuple[StagedUpdate, str | None, int | None]] = []
        try:
            for step in steps:
                staged = step()
                before = (self.run_id, self.version)
                if self.apply(staged):
                    done.append((staged, *before))
        except BaseException as exc:
            for staged, run_id, version in reversed(done):
                if staged.meta.kind == "anchor":
                    log.error(
                        "update failed after anchor %d was written; serving version %s: %s",
                        staged.meta.version,
                        self.version,
                        exc,
                    )
                    break
                self.revert(staged, run_id, version)
            raise
        return [staged.meta.version for staged, _, _ in done]

    def revert(self, staged: StagedUpdate, run_id: str | None, version: int | None) -> None:
        """Undo an applied delta (anchors cannot be undone without a shadow)."""
        if staged.noop:
            return
        if staged.meta.kind == "anchor":
            raise ChainError(
                f"anchor {staged.meta.version} stays applied: the GPU path keeps no copy of the "
                "previous weights",
                expected=version,
                found=staged.meta.version,
            )
        self._write(staged, previous=True)
        _synchronize(self._views)
        self.run_id, self.version = run_id, version

    def _write(self, staged: StagedUpdate, *, previous: bool) -> None:
        assert staged.decoded is not None
        for name, change in staged.decoded.changes.items():
            view = self._views[name]
            values = change.previous if previous else change.values
            index = change.indices.to(view.device, non_blocking=True)
            view.view(-1).index_copy_(0, index, values.to(view.device, non_blocking=True))

    def digests(self) -> dict[str, str]:
        """Digests of the served parameters themselves (one host copy per tensor)."""
        return {name: tensor_digest(_host_copy(view)) for name, view in self._views.items()}

    def _check_chain(self, meta: FileMetadata, path: str | None) -> None:
        if self.version is None:
            raise ChainError(
                f"cannot apply delta {meta.version} before an anchor",
                expected="anchor",
                found="delta",
            )
        if meta.legacy:
            return
        if meta.run_id != self.run_id or meta.base_version != self.version:
            raise ChainError(
                f"delta {meta.version} of run {meta.run_id!r} has base {meta.base_version}; the "
                f"replica serves version {self.version} of run {self.run_id!r}"
                f"{f' ({path})' if path else ''}",
                expected=(self.run_id, self.version),
                found=(meta.run_id, meta.base_version),
            )


def _synchronize(views: Mapping[str, torch.Tensor]) -> None:
    device = next(iter(views.values())).device if views else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
