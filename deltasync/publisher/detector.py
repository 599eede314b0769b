"""What the publisher asks of its change detection: the last published bf16 state and the exact
per-tensor changes from it. `snapshot.Bf16Snapshot` scans on the host; `device_snapshot.
DeviceSnapshot` compares on the parameters' device against a bf16 reference there and copies
only the changes to the host."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from deltasync.kernels.changes import Diff
from deltasync.publisher.snapshot import NamedTensors

__all__ = ["ChangeDetector"]


class ChangeDetector(Protocol):
    """The base every delta is computed against; it moves only through `advance`, after a
    publish commits, so a failed publish never moves it under the next delta.

    `hashes_inline`: ask `diff` for the digests - the host scan hashes each tensor while its
    bytes are hot; the device scan copies only changes to the host, so the publisher's worker
    hashes its mirror instead (False).
    """

    hashes_inline: bool

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The bf16 state of the last committed version, on the host."""

    def diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Diff:
        """Exact changes of `source` from the state `pending` (handed out, not committed yet)
        leads to, with every tensor's new digest when `digests`."""

    def start_diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Callable[[], Diff]:
        """`diff` in two halves: what must read the weights now (the training thread waits for
        it), the rest when the returned call is made (once, before the next `start_diff`)."""

    def advance(self, diff: Diff) -> None:
        """Move to the state `diff` describes, once its version committed."""
