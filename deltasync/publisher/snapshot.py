"""Bitwise change detection: a bf16 snapshot of named parameters and its exact diff."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltasync.errors import FormatError
from deltasync.kernels.bitscan import changed_elements
from deltasync.kernels.changes import WORKERS, Diff, TensorChange, scatter
from deltasync.kernels.changes import bits as _bits
from deltasync.wire.digests import tensor_digest

__all__ = [
    "NAN_BITS",
    "WINDOW",
    "Bf16Snapshot",
    "NamedTensors",
    "bf16_on_host",
    "bf16_view",
    "canonical_nan",
    "check_names",
    "digests_after",
    "fold_pending",
    "named_items",
    "named_tensors",
    "state_after",
    "to_bf16",
]

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module


NAN_BITS = 0x7FC0
"""The one bf16 NaN a conversion gives: positive, quiet, no payload (see `to_bf16`)."""

WINDOW = 1 << 24
"""Elements converted (and compared, on the device) at a time: bounds the device's transient."""


def to_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as bf16, converted where it lives, by the one rule both change detections follow.

    bf16 tensors pass as they are: their bits are the weights, NaN payloads included. Other
    dtypes round to nearest, ties to even (torch's conversion on CPU and CUDA alike): subnormals
    are kept (the smallest fp32 ones round to +-0), zeros keep their sign, values past the largest
    bf16 round to +-inf; and every NaN, whatever its sign and payload, becomes `NAN_BITS`
    (`canonical_nan`).
    """
    if tensor.dtype == torch.bfloat16:
        return tensor.detach()
    return canonical_nan(tensor.detach().to(torch.bfloat16))


def canonical_nan(converted: torch.Tensor) -> torch.Tensor:
    """`converted`, a bf16 conversion the caller owns, with every NaN rewritten in place to
    `NAN_BITS` 0x7FC0: torch's own NaN depends on the device and the CPU kernel (0x7FC0 scalar,
    0xFFFF vectorised AVX-512, 0x7FFF CUDA), and digests and the scan compare bits."""
    # a finite sum holds no NaN: one cheap pass instead of a mask, on the CPU only (on a device
    # reading the sum back would make the host wait); read through numpy, no torch op
    if converted.device.type == "cpu" and np.isfinite(converted.sum().float().numpy()):
        return converted
    bits = converted.view(torch.int16)
    return bits.masked_fill_(converted.isnan(), NAN_BITS).view(torch.bfloat16)


def bf16_view(tensor: torch.Tensor, window: int = WINDOW) -> torch.Tensor:
    """The contiguous bf16 CPU view of a parameter (`to_bf16`).

    A parameter on a device is converted there in windows of `window` elements, so 2 bytes per
    element cross to the host (not fp32's 4) and the device holds at most one window's bf16.
    Returns the input itself when it already is a contiguous bf16 CPU tensor: callers that keep
    the result past the current step must copy it.
    """
    if tensor.device.type == "cpu":
        return to_bf16(tensor).contiguous()
    return bf16_on_host(tensor, window)


def bf16_on_host(tensor: torch.Tensor, window: int = WINDOW) -> torch.Tensor:
    """A new contiguous bf16 CPU copy of `tensor`, converted window by window where it lives."""
    flat = tensor.detach().reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.bfloat16)
    for start in range(0, flat.numel(), window):
        out[start : start + window].copy_(to_bf16(flat[start : start + window]))
    return out.view(tensor.shape)


def named_items(source: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as `source` holds them: a module's parameters, a mapping's items."""
    if isinstance(source, torch.nn.Module):
        return source.named_parameters()
    return source.items() if isinstance(source, Mapping) else source


def named_tensors(source: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module, a state dict or an iterable, without tied aliases.

    A tensor that shares storage, offset and shape with an earlier one (tied embeddings in a state
    dict) is skipped, as `Module.named_parameters()` does and as HF checkpoints expect.
    """
    seen: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
    names: set[str] = set()
    out = []
    for name, tensor in named_items(source):
        if name in names:
            raise FormatError(f"duplicate parameter name {name!r}")
        names.add(name)
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def _changed(
    base: torch.Tensor, new: torch.Tensor, pending: tuple[np.ndarray, np.ndarray] | None
) -> TensorChange | None:
    """Exact bitwise comparison of `new` with `base` overlaid by `pending` (indices, bits)."""
    base_bits, new_bits = _bits(base), _bits(new)
    indices, values, reference = changed_elements(base_bits, new_bits)
    if pending is not None:
        # The reference state is base with the pending (not yet committed) versions applied;
        # only the union of both index sets can differ from it.
        pending_idx, pending_bits = pending
        indices = np.union1d(indices, pending_idx)
        reference = base_bits[indices]
        reference[np.searchsorted(indices, pending_idx)] = pending_bits
        values = new_bits[indices]
        keep = reference != values
        indices, values, reference = indices[keep], values[keep], reference[keep]
    if indices.size == 0:
        return None
    return TensorChange(
        torch.from_numpy(indices),
        torch.from_numpy(values).view(torch.bfloat16),
        torch.from_numpy(reference).view(torch.bfloat16),
    )


def fold_pending(pending: Sequence[Diff]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Merge consecutive diffs into one overlay per tensor: the last write of an index wins."""
    per_tensor: dict[str, list[TensorChange]] = {}
    for diff in pending:
        for name, change in diff.changes.items():
            per_tensor.setdefault(name, []).append(change)
    folded = {}
    for name, changes in per_tensor.items():
        idx = np.concatenate([c.indices.numpy() for c in changes])
        bits = np.concatenate([c.values.view(torch.int16).numpy() for c in changes])
        order = np.argsort(idx, kind="stable")
        idx, bits = idx[order], bits[order]
        last = np.append(idx[1:] != idx[:-1], True)
        folded[name] = (idx[last], bits[last])
    return folded


def check_names(items: Sequence[tuple[str, torch.Tensor]], tensors: Mapping[str, object]) -> None:
    """The parameters to diff must be the snapshot's `tensors`, no more and no fewer."""
    names, known = {n for n, _ in items}, set(tensors)
    if names != known:
        missing, unknown = sorted(known - names)[:5], sorted(names - known)[:5]
        raise FormatError(
            f"parameter names differ from the snapshot: missing {missing}, unknown {unknown}"
        )


def state_after(tensors: Mapping[str, torch.Tensor], diff: Diff | None) -> dict[str, torch.Tensor]:
    """The full bf16 state once `diff` is applied to `tensors`, copying only the tensors it
    touches."""
    state = dict(tensors)
    for name, change in (diff.changes if diff else {}).items():
        patched = state[name].clone()
        scatter(patched, change.indices, change.values)
        state[name] = patched
    return state


def digests_after(tensors: Mapping[str, torch.Tensor], diff: Diff) -> dict[str, str]:
    """Every tensor's xxh3 once `diff` is applied to `tensors` (one patched copy at a time)."""

    def one(name: str) -> str:
        change = diff.changes.get(name)
        if change is None:
            return tensor_digest(tensors[name])
        patched = tensors[name].clone()
        scatter(patched, change.indices, change.values)
        return tensor_digest(patched)

    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip(tensors, pool.map(one, tensors), strict=True))


class Bf16Snapshot:
    """The last published bf16 state, the base every delta is computed against.

    The snapshot only moves through `advance`, after a publish commits, so a failed publish never
    moves the base under the next delta (a takeover or restart builds a new one from the bucket).
    A `detector.ChangeDetector`.
    """

    hashes_inline = True

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, tensor in tensors.items():
            if tensor.dtype != torch.bfloat16 or tensor.device.type != "cpu":
                raise FormatError("snapshot tensors must be bf16 on the CPU", tensor=name)
        self._tensors = {name: t.contiguous() for name, t in tensors.items()}

    @classmethod
    def capture(cls, source: NamedTensors) -> Bf16Snapshot:
        """Copy the bf16 view of every parameter (fp32 or bf16, any device)."""
        return cls({name: bf16_view(t).clone() for name, t in named_tensors(source)})

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def digests(self) -> dict[str, str]:
        return {name: tensor_digest(t) for name, t in self._tensors.items()}

    def diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Diff:
        """Exact per-tensor changes to `source` (same names and shapes) from this snapshot.

        Args:
            source: the current weights (module, state dict or pairs; fp32 or bf16).
            pending: diffs already handed to the publisher but not committed yet, oldest first;
                the result is then relative to the state they lead to, so versions chain while
                the snapshot itself stays at the last committed version.
            digests: hash every tensor's new bytes (off for a rank's boxes of sharded
                parameters, which are no whole tensors).

        Runs over tensors in a small thread pool (the compiled scan and xxhash release the GIL).
        """
        overlay = fold_pending(pending)
        items = named_tensors(source)
        check_names(items, self._tensors)

        def one(item: tuple[str, torch.Tensor]) -> tuple[str, TensorChange | None, str | None]:
            name, tensor = item
            base = self._tensors[name]
            if tuple(tensor.shape) != tuple(base.shape):
                raise FormatError(
                    f"shape changed from {tuple(base.shape)} to {tuple(tensor.shape)}", tensor=name
                )
            new = bf16_view(tensor)
            digest = tensor_digest(new) if digests else None
            return name, _changed(base, new, overlay.get(name)), digest

        with ThreadPoolExecutor(WORKERS) as pool:
            results = list(pool.map(one, items))
        changes = {name: change for name, change, _ in results if change is not None}
        hashes = {name: digest for name, _, digest in results if digest is not None}
        shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}
        return Diff(changes, hashes, shapes)

    def start_diff(
        self, source: NamedTensors, pending: Sequence[Diff] = (), *, digests: bool = True
    ) -> Callable[[], Diff]:
        """`diff` for a caller that takes the result later: the host scan has it at once."""
        diff = self.diff(source, pending, digests=digests)
        return lambda: diff

    def advance(self, diff: Diff) -> None:
        """Move the snapshot to the state the diff describes (call once the publish committed)."""
        for name, change in diff.changes.items():
            scatter(self._tensors[name], change.indices, change.values)
