"""Change detection where the parameters live: a bf16 reference on the trainer's device.

The host path (`Bf16Snapshot.diff`) copies every parameter to the host as bf16 and scans it there
on the training thread: on a GPU trainer that is 2 bytes per parameter over PCIe every step. Here
the compare runs on the parameters' device against a device-resident bf16 reference (2 bytes per
parameter of device memory, one flat buffer over every tensor), in windows of at most `WINDOW`
elements so the transient stays bounded, and only the changed elements' int32 window indices and
new values cross to the host (6 bytes each); their previous values are read from the host mirror.

On a GPU what costs is each time the host waits for the device (a result whose size depends on
values, a number read back, a copy to the host), not bandwidth: a diff waits a constant number of
times whatever the model's size (`DeviceSnapshot.start_diff`: the windows' counts, then one
compaction into a preallocated buffer; the copies to the host run on a stream of their own and
the publisher's worker waits for them). `bench.host_waits` counts those operations on CPU tensors.

The host mirror of the last committed version (a `Bf16Snapshot`) moves in O(changed) through
`advance`, in the publisher's thread, and is what anchors, digests and resumes read; the device
reference never leaves the device. It holds the state of the last version handed out (committed
or still in flight), which is what the host path reconstructs from its `pending` overlay; when
the publisher drops in-flight versions after a failure (`pending` shorter than the diffs not yet
advanced), the reference is reloaded from the host mirror once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

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

TRANSIENT_BYTES = 21
"""Device bytes per window element one compare may hold at worst (every element changed): the
pieces of tensors a window spans joined (4, fp32), its bf16 (2) and a mask (1), the changed
elements' int64 indices (8), their int32 copy (4), the new values (2). The buffer of a step's
changed elements (6 bytes each) comes on top, within `DeviceSnapshot`'s `compact_bytes`."""

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

    The reference is one flat buffer over every tensor (the host mirror's order), compared in
    windows of at most `window` elements that may span several tensors, so the number of
    launches follows the model's size, not its tensor count. A diff waits on the device a
    constant number of times (`diff`). Every copy to the host goes through `to_host` (tests
    count its bytes). `compact_bytes` caps the device buffer of changed elements (6 bytes
    each; default: half the device's free memory, unlimited where torch cannot tell); a step
    that needs more is compared window by window instead, which says so in one log line.
    A `detector.ChangeDetector`.
    """

    hashes_inline = False

    def __init__(
        self,
        host: Bf16Snapshot,
        device: torch.device | str,
        *,
        window: int = WINDOW,
        to_host: ToHost = _to_host,
        compact_bytes: int | None = None,
        free_bytes: FreeBytes = device_free_bytes,
    ):
        if window < 1 or window > 2**31:
            raise ValueError(f"window must be in [1, 2**31] (int32 indices), got {window}")
        self.host = host
        self.device = normalize_device(device)
        self.window = window
        self._to_host = to_host
        self._compact_bytes = compact_bytes
        self._free_bytes = free_bytes
        names = list(host.tensors)
        sizes = np.array([host.tensors[n].numel() for n in names], np.int64)
        self._names = names
        self._starts = np.concatenate(([0], np.cumsum(sizes)))  # each tensor's flat offset
        self._reference: torch.Tensor | None = None  # loaded from `host` on demand
        self._found: torch.Tensor | None = None  # int32 window indices, grown on demand
        self._values: torch.Tensor | None = None  # bf16 new values, as many
        self._ahead = 0  # diffs handed out and not advanced yet
        self._stream: torch.cuda.Stream | None = None  # the copies to the host (CUDA)
        self._copied: torch.cuda.Event | None = None  # when the last of them is done

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The host mirror: the bf16 state of the last committed version."""
        return self.host.tensors

    @property
    def buffer_bytes(self) -> int:
        """Device bytes held for the changed elements between steps (6 each)."""
        return 0 if self._found is None else 6 * self._found.numel()

    def diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Diff:
        """Exact per-tensor changes of `source` from the last version handed out: what
        `Bf16Snapshot.diff` returns for the same arguments. `digests` hashes the host mirror
        with the changes applied (the publisher passes False and hashes in its own thread)."""
        return self.start_diff(source, pending, digests=digests)()

    def start_diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Callable[[], Diff]:
        """`diff` in two halves: the compare now, the changes on the host later (call the
        result, once, in the thread that needs them; before the next `start_diff`).

        On the device: one pass counts each window's changed elements (one copy of the counts
        to the host: the only wait here), a second writes the changed elements' window indices
        and new values into one preallocated buffer (`nonzero_static`: no wait) and moves the
        reference. The buffer's used part then comes to pinned host memory on a stream of its
        own (CUDA) and the returned call waits for it; elsewhere the call copies it. The
        previous values come from the host mirror."""
        if len(pending) != self._ahead:  # in-flight versions were dropped: back to committed
            self._reference, self._ahead = None, len(pending)
            if pending:
                raise FormatError("the device reference cannot rewind to a pending version")
        tensors = self._checked(source)
        reference = self._reference_buffer()
        with torch.no_grad():
            changed = self._changed(tensors, reference)
        self._ahead += 1
        shapes = {name: tuple(t.shape) for name, t in self.host.tensors.items()}

        def finish() -> Diff:  # host work only: the publisher's worker runs it
            at, values = changed()
            diff = Diff(self._split(at, values, fold_pending(pending)), {}, shapes)
            if not digests:
                return diff
            base: Mapping[str, torch.Tensor] = self.host.tensors  # committed: fold pending in
            for earlier in pending:
                base = state_after(base, earlier)
            return replace(diff, digests=digests_after(base, diff))

        return finish

    def advance(self, diff: Diff) -> None:
        """Move the host mirror to the version `diff` leads to (once it committed)."""
        self.host.advance(diff)
        self._ahead = max(0, self._ahead - 1)

    def _checked(self, source: NamedTensors) -> list[torch.Tensor]:
        """`source`'s tensors, flat, in the host mirror's order, each checked against it."""
        items = named_tensors(source)
        check_names(items, self.host.tensors)
        by_name = dict(items)
        out = []
        for name in self._names:
            tensor, committed = by_name[name], self.host.tensors[name]
            if tuple(tensor.shape) != tuple(committed.shape):
                raise FormatError(
                    f"shape changed from {tuple(committed.shape)} to {tuple(tensor.shape)}",
                    tensor=name,
                )
            if normalize_device(tensor.device) != self.device:
                raise FormatError(f"on {tensor.device}, not {self.device}", tensor=name)
            out.append(tensor.detach().reshape(-1))
        return out

    def _reference_buffer(self) -> torch.Tensor:
        if self._reference is None:
            flat = [t.reshape(-1) for t in self.host.tensors.values()]
            joined = torch.cat(flat) if flat else torch.empty(0, dtype=torch.bfloat16)
            self._reference = joined.to(self.device)  # a new tensor already: no second copy
        return self._reference

    def _windows(self, tensors: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, the new bf16 values of the flat elements [start, start + window)): one
        window may hold the end of a tensor and the start of the next ones."""
        total = int(self._starts[-1])
        for start in range(0, total, self.window):
            stop = min(start + self.window, total)
            first = int(np.searchsorted(self._starts, start, side="right")) - 1
            pieces = []
            index = first
            while index < len(tensors) and self._starts[index] < stop:
                lo = max(start, int(self._starts[index])) - int(self._starts[index])
                hi = min(stop, int(self._starts[index + 1])) - int(self._starts[index])
                if hi > lo:
                    pieces.append(tensors[index][lo:hi])
                index += 1
            if len(pieces) > 1 and len({p.dtype for p in pieces}) > 1:
                pieces = [to_bf16(p) for p in pieces]  # mixed dtypes
            joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            yield start, to_bf16(joined)

    def _changed(
        self, tensors: list[torch.Tensor], reference: torch.Tensor
    ) -> Callable[[], tuple[np.ndarray, torch.Tensor]]:
        """The reference moved to the new values; returns the call that gives the changed
        elements' global flat indices (int64, ascending) and new values on the host."""
        counts = [
            (new.view(torch.int16) != reference[start : start + new.numel()].view(torch.int16))
            .count_nonzero()
            .reshape(1)
            for start, new in self._windows(tensors)
        ]
        if not counts:
            return lambda: (np.empty(0, np.int64), torch.empty(0, dtype=torch.bfloat16))
        per_window = self._to_host(torch.cat(counts)).numpy()  # the one wait before the copies
        total, budget = int(per_window.sum()), self._budget()
        if 6 * total > budget:
            log.info(
                "change detection: %d changed elements need %.2f GiB of device buffer, over "
                "the budget: compared window by window this step",
                total,
                6 * total / 2**30,
            )
            found = self._changed_by_window(tensors, reference)
            return lambda: found
        if self._found is None or self._values is None or total > self._found.numel():
            grown = 0 if self._found is None else self._found.numel() * 5 // 4
            room = max(total, int(min(grown, budget // 6)))  # a little ahead, within budget
            self._found = torch.empty(room, dtype=torch.int32, device=self.device)
            self._values = torch.empty(room, dtype=torch.bfloat16, device=self.device)
        if self._copied is not None:  # the last diff's copies read the buffers: wait, on device
            torch.cuda.current_stream(self.device).wait_event(self._copied)
        put = 0
        for (start, new), count in zip(self._windows(tensors), per_window.tolist(), strict=True):
            if count == 0:
                continue  # its reference already holds these values
            window = reference[start : start + new.numel()]
            changed = new.view(torch.int16) != window.view(torch.int16)
            local = torch.nonzero_static(changed, size=count).squeeze(1)
            self._found[put : put + count] = local.to(torch.int32)
            self._values[put : put + count] = new[local]
            window.copy_(new)  # a dense write of the window: no scatter, no index kept
            put += count
        copied = self._copy_later(self._found[:total], self._values[:total])
        starts = np.repeat(np.arange(0, int(self._starts[-1]), self.window), per_window)

        def on_host() -> tuple[np.ndarray, torch.Tensor]:
            local, values = copied()
            return local.to(torch.int64).numpy() + starts, values

        return on_host

    def _copy_later(self, *tensors: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Copies of device `tensors` on the host, for later: on CUDA into pinned memory on a
        stream of its own (the training stream goes on), waited for by the call; elsewhere
        made by the call (`to_host`)."""
        if self.device.type != "cuda":
            return lambda: tuple(self._to_host(t) for t in tensors)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in tensors:  # a buffer replaced meanwhile stays allocated until copied
            tensor.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            copies = tuple(torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors)
            for copy, tensor in zip(copies, tensors, strict=True):
                copy.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._copied = done

        def wait() -> tuple[torch.Tensor, ...]:
            done.synchronize()
            return copies

        return wait

    def _changed_by_window(
        self, tensors: list[torch.Tensor], reference: torch.Tensor
    ) -> tuple[np.ndarray, torch.Tensor]:
        """The same, a window at a time (a wait per window; no buffer of every change)."""
        indices, values = [np.empty(0, np.int64)], [torch.empty(0, dtype=torch.bfloat16)]
        for start, new in self._windows(tensors):
            window = reference[start : start + new.numel()]
            local = (new.view(torch.int16) != window.view(torch.int16)).nonzero().squeeze(1)
            if local.numel():
                indices.append(self._to_host(local.to(torch.int32)).to(torch.int64).numpy() + start)
                values.append(self._to_host(new[local]))
                window.copy_(new)
        return np.concatenate(indices), torch.cat(values)

    def _budget(self) -> float:
        if self._compact_bytes is not None:
            return self._compact_bytes
        free = self._free_bytes(self.device)
        return math.inf if free is None else free / 2

    def _split(
        self,
        at: np.ndarray,
        values: torch.Tensor,
        overlay: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> dict[str, TensorChange]:
        """Per-tensor changes from global flat indices, each with its previous values."""
        bounds = np.searchsorted(at, self._starts)
        changes = {}
        for i, name in enumerate(self._names):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi == lo:
                continue
            local = torch.from_numpy(at[lo:hi] - self._starts[i])
            previous = _previous(self.host.tensors[name], local, overlay.get(name))
            changes[name] = TensorChange(local, values[lo:hi].clone(), previous)
        return changes


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
