"""Change detection where the parameters live: a bf16 reference on the trainer's device.

The host path (`Bf16Snapshot.diff`) copies every parameter to the host as bf16 and scans it there
on the training thread: on a GPU trainer that is 2 bytes per parameter over PCIe every step. Here
the compare runs on the parameters' device against a device-resident bf16 reference (2 bytes per
parameter of device memory), and only the changed elements (index, new and previous value) cross
to the host. The host mirror of the last committed version (a `Bf16Snapshot`) still moves in
O(changed) through `advance`, in the publisher's thread, and is what anchors, digests and resumes
read; the device reference never leaves the device.

The device reference holds the state of the last version handed out (committed or still in
flight), which is what the host path reconstructs from its `pending` overlay; when the publisher
drops in-flight versions after a failure (`pending` shorter than the diffs not yet advanced), the
reference is reloaded from the host mirror once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltasync.errors import FormatError
from deltasync.kernels.changes import Diff, TensorChange
from deltasync.publisher.snapshot import (
    Bf16Snapshot,
    NamedTensors,
    check_names,
    digests_after,
    named_tensors,
    state_after,
)

__all__ = ["DeviceSnapshot", "detection_device"]


def detection_device(source: NamedTensors, mode: str) -> torch.device | None:
    """Where `mode` ("host", "device" or "auto": device when the parameters are not on the CPU)
    runs change detection for `source`; None means the host path."""
    if mode not in ("host", "device", "auto"):
        raise ValueError(f"change detection must be host, device or auto, got {mode!r}")
    if mode == "host":
        return None
    devices = {t.device for _, t in named_tensors(source)}
    if len(devices) > 1:
        raise FormatError(f"parameters on several devices {sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    return None if mode == "auto" and device.type == "cpu" else device


class DeviceSnapshot:
    """A `Bf16Snapshot` (the host mirror) plus a bf16 reference on the parameters' device."""

    def __init__(self, host: Bf16Snapshot, device: torch.device):
        self.host = host
        self.device = torch.device(device)
        self._reference: dict[str, torch.Tensor] | None = None  # loaded from `host` on demand
        self._ahead = 0  # diffs handed out and not advanced yet

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The host mirror: the bf16 state of the last committed version."""
        return self.host.tensors

    def digests(self) -> dict[str, str]:
        return self.host.digests()

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
        changes = {}
        with torch.no_grad():
            for name, tensor in items:
                shape = tuple(self.host.tensors[name].shape)
                if tuple(tensor.shape) != shape:
                    raise FormatError(
                        f"shape changed from {shape} to {tuple(tensor.shape)}", tensor=name
                    )
                if tensor.device != self.device:
                    raise FormatError(f"on {tensor.device}, not {self.device}", tensor=name)
                change = _changed_on_device(reference[name], tensor)
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


def _changed_on_device(reference: torch.Tensor, tensor: torch.Tensor) -> TensorChange | None:
    """Compare on the device, copy only the changed elements to the host, move the reference."""
    new = tensor.detach().to(torch.bfloat16).reshape(-1)  # round-to-nearest-even, as on the host
    indices = (new.view(torch.int16) != reference.view(torch.int16)).nonzero().squeeze(1)
    if indices.numel() == 0:
        return None
    values, previous = new[indices], reference[indices]
    reference[indices] = values
    return TensorChange(
        indices.to("cpu"), values.to("cpu", copy=True), previous.to("cpu", copy=True)
    )
