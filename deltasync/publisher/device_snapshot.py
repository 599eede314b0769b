"""Change detection where the parameters live: a bf16 reference on the trainer's device.

The host path (`Bf16Snapshot.diff`) copies every parameter to the host as bf16 and scans it there
on the training thread: on a GPU trainer that is 2 bytes per parameter over PCIe every step. Here
the compare runs on the parameters' device against a device-resident bf16 reference (2 bytes per
parameter of device memory), in windows of at most `WINDOW` elements so the transient stays
bounded, and only the changed elements' int32 window indices and new values cross to the host
(6 bytes each); their previous values are read from the host mirror. The host mirror of the last
committed version (a `Bf16Snapshot`) moves in O(changed) through `advance`, in the publisher's
thread, and is what anchors, digests and resumes read; the device reference never leaves the
device.

The device reference holds the state of the last version handed out (committed or still in
flight), which is what the host path reconstructs from its `pending` overlay; when the publisher
drops in-flight versions after a failure (`pending` shorter than the diffs not yet advanced), the
reference is reloaded from the host mirror once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from deltasync.errors import FormatError
from deltasync.kernels.changes import Diff, TensorChange
from deltasync.kernels.changes import bits as _bits
from deltasync.publisher.snapshot import (
    WINDOW,
    Bf16Snapshot,
    NamedTensors,
    check_names,
    digests_after,
    fold_pending,
    named_tensors,
    state_after,
    to_bf16,
)

__all__ = [
    "TRANSIENT_BYTES",
    "DeviceSnapshot",
    "detection_device",
    "device_bytes_needed",
    "device_free_bytes",
    "normalize_device",
]

log = logging.getLogger(__name__)

TRANSIENT_BYTES = 17
"""Device bytes per window element one compare may hold at worst (every element changed): the
window's bf16 (2) and a mask (1), nonzero's int64 indices (8), their int32 copy (4), the new
values (2)."""

FreeBytes = Callable[[torch.device], int | None]
ToHost = Callable[[torch.Tensor], torch.Tensor]


def normalize_device(device: torch.device | str) -> torch.device:
    """`device` with an index: `cuda` means the current CUDA device, which tensors report as
    `cuda:<index>`, so devices compare equal only once normalised. Other types pass as they are."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` as its allocator sees it; None where torch cannot tell."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def device_bytes_needed(sizes: Sequence[int], window: int = WINDOW) -> int:
    """Device memory detection takes for tensors of `sizes` elements: the reference (2 bytes per
    element, held) plus one window's transient at worst."""
    return 2 * sum(sizes) + TRANSIENT_BYTES * min(window, max(sizes, default=0))


def detection_device(
    source: NamedTensors,
    mode: str,
    *,
    free_bytes: FreeBytes = device_free_bytes,
    window: int = WINDOW,
) -> torch.device | None:
    """Where `mode` runs change detection for `source`; None means the host path. Logs the choice.

    `host` and `device` are taken as asked. `auto` picks the parameters' device unless they are
    on the CPU or `free_bytes` reports less than `device_bytes_needed` there (or cannot tell): the
    reference would otherwise be allocated in the trainer's memory and could fail it later.
    """
    if mode not in ("host", "device", "auto"):
        raise ValueError(f"change detection must be host, device or auto, got {mode!r}")
    items = named_tensors(source)
    devices = {normalize_device(t.device) for _, t in items}
    if len(devices) > 1:
        raise FormatError(f"parameters on several devices {sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    if mode == "auto":
        on_device, reason = _auto(device, [t.numel() for _, t in items], free_bytes, window)
    else:
        on_device, reason = mode == "device", "asked for"
    log.info("change detection: %s (%s)", f"device on {device}" if on_device else "host", reason)
    return device if on_device else None


def _auto(
    device: torch.device, sizes: list[int], free_bytes: FreeBytes, window: int
) -> tuple[bool, str]:
    """`auto`'s choice for parameters on `device` and why, in words for the log."""
    if device.type == "cpu":
        return False, "auto: the parameters are on the CPU"
    free, need = free_bytes(device), device_bytes_needed(sizes, window)
    if free is None:
        return False, f"auto: free memory on {device} unknown"
    figures = f"needs {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free on {device}"
    return free >= need, f"auto: device detection {figures}"


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=True)


class DeviceSnapshot:
    """A `Bf16Snapshot` (the host mirror) plus a bf16 reference on the parameters' device.

    `window` bounds the elements compared at a time; every copy to the host goes through
    `to_host` (tests count its bytes). A `detector.ChangeDetector`.
    """

    hashes_inline = False

    def __init__(
        self,
        host: Bf16Snapshot,
        device: torch.device | str,
        *,
        window: int = WINDOW,
        to_host: ToHost = _to_host,
    ):
        if window < 1 or window > 2**31:
            raise ValueError(f"window must be in [1, 2**31] (int32 indices), got {window}")
        self.host = host
        self.device = normalize_device(device)
        self.window = window
        self._to_host = to_host
        self._reference: dict[str, torch.Tensor] | None = None  # loaded from `host` on demand
        self._ahead = 0  # diffs handed out and not advanced yet

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The host mirror: the bf16 state of the last committed version."""
        return self.host.tensors

    def diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Diff:
        """Exact per-tensor changes of `source` from the last version handed out: what
        `Bf16Snapshot.diff` returns for the same arguments. `digests` hashes the host mirror
        with the changes applied (the publisher passes False and hashes in its own thread)."""
        if len(pending) != self._ahead:  # in-flight versions were dropped: back to committed
            self._reference, self._ahead = None, len(pending)
            if pending:
                raise FormatError("the device reference cannot rewind to a pending version")
        items = named_tensors(source)
        check_names(items, self.host.tensors)
        reference = self._reference_tensors()
        overlay = fold_pending(pending)
        changes = {}
        with torch.no_grad():
            for name, tensor in items:
                committed = self.host.tensors[name]
                if tuple(tensor.shape) != tuple(committed.shape):
                    raise FormatError(
                        f"shape changed from {tuple(committed.shape)} to {tuple(tensor.shape)}",
                        tensor=name,
                    )
                if normalize_device(tensor.device) != self.device:
                    raise FormatError(f"on {tensor.device}, not {self.device}", tensor=name)
                change = self._changed(reference[name], tensor, committed, overlay.get(name))
                if change is not None:
                    changes[name] = change
        self._ahead += 1
        shapes = {name: tuple(t.shape) for name, t in self.host.tensors.items()}
        diff = Diff(changes, {}, shapes)
        if not digests:
            return diff
        base: Mapping[str, torch.Tensor] = self.host.tensors  # committed: fold the pending in
        for earlier in pending:
            base = state_after(base, earlier)
        return Diff(changes, digests_after(base, diff), shapes)

    def advance(self, diff: Diff) -> None:
        """Move the host mirror to the version `diff` leads to (once it committed)."""
        self.host.advance(diff)
        self._ahead = max(0, self._ahead - 1)

    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        if self._reference is None:
            self._reference = {
                name: t.to(self.device, copy=True).reshape(-1)
                for name, t in self.host.tensors.items()
            }
        return self._reference

    def _changed(
        self,
        reference: torch.Tensor,
        tensor: torch.Tensor,
        committed: torch.Tensor,
        pending: tuple[np.ndarray, np.ndarray] | None,
    ) -> TensorChange | None:
        """Compare window by window on the device and move the reference; the indices (int64,
        offset on the host) and new values come over, the previous values from the host."""
        flat = tensor.detach().reshape(-1)
        indices, values = [], []
        for start in range(0, flat.numel(), self.window):
            stop = start + self.window
            found = _changed_on_device(reference[start:stop], flat[start:stop])
            if found is not None:
                local, new = (self._to_host(t) for t in found)
                indices.append(local.to(torch.int64).add_(start))
                values.append(new)
        if not indices:
            return None
        at = torch.cat(indices)
        return TensorChange(at, torch.cat(values), _previous(committed, at, pending))


def _changed_on_device(
    reference: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One window compared on the device: its changed elements' int32 local indices and new
    bf16 values (still on the device), None when none changed; the reference takes the window."""
    new = to_bf16(window)
    local = (new.view(torch.int16) != reference.view(torch.int16)).nonzero().squeeze(1)
    if local.numel() == 0:
        return None
    values = new[local]
    reference.copy_(new)  # a dense write of the window: no scatter, no index kept
    return local.to(torch.int32), values


def _previous(
    committed: torch.Tensor, indices: torch.Tensor, pending: tuple[np.ndarray, np.ndarray] | None
) -> torch.Tensor:
    """The values at `indices` in the last version handed out: the host mirror's committed
    values, overlaid by the versions still in flight (`fold_pending`)."""
    at = indices.numpy()
    out = _bits(committed)[at]
    if pending is not None:
        pending_at, pending_bits = pending
        slot = np.minimum(np.searchsorted(pending_at, at), pending_at.size - 1)
        hit = pending_at[slot] == at
        out[hit] = pending_bits[slot[hit]]
    return torch.from_numpy(out).view(torch.bfloat16)
