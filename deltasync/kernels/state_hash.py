"""Computing `cubesum-4x31` digests (`deltasync.wire.digests`): compiled loops on CPU, integer
tensor ops on any torch device, bit-identical (exact integer arithmetic both ways).

The CPU kernels run one vectorised pass per lane with the lane's prime as a constant: products of
two numbers below 2^32 (`vpmuludq`) and a lazy reduction x -> (x & (2^31-1)) + (x >> 31) * k
(since 2^31 = k mod p), about 6.6 ns per element for all four lanes on one core.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltasync.kernels.changes import WORKERS, TensorChange
from deltasync.kernels.jit import compiled
from deltasync.wire.digests import LANE_K, PRIMES, StateDigest, tensor_keys, total

__all__ = [
    "apply_changes",
    "change_sum",
    "device_sum",
    "full_state_digest",
    "indexed_sum",
    "state_sums",
    "tensor_sum",
]

_LOW31 = (1 << 31) - 1
_LOW32 = 0xFFFFFFFF
_CHUNK = 1 << 24  # elements per task: splits big tensors over the worker threads
_DEVICE_CHUNK = 1 << 20  # elements per device pass (`device_sum`): about 120 MiB transient
_MAX_DEVICE_CHUNK = 1 << 22


@compiled
def _fold(x, k):  # pragma: no cover - compiled; x < 2^63 -> below 2^31 + (2k+1)k, same mod p
    x = (x & _LOW31) + ((x >> 31) & _LOW32) * k
    return (x & _LOW31) + ((x >> 31) & _LOW32) * k


@compiled
def _cube(x, k):  # pragma: no cover - compiled; x < 2^32
    x = x & _LOW32
    square = _fold(x * x, k) & _LOW32
    return _fold(square * x, k)


@compiled
def _range_lane(bits, lo, a, g, b, k):  # pragma: no cover - compiled
    """Sum of h over bits[j] at index lo + j (all below 2^31; g holds the a_hi term)."""
    s = np.int64(0)
    for j in range(bits.size):
        w = (np.int64(bits[j]) & 0xFFFF) + 1
        s += _cube(_fold((a & _LOW32) * ((lo + j) & _LOW32) + g + (b & _LOW32) * w, k), k)
    return s


@compiled
def _range_sums(bits, lo, keys, out):  # pragma: no cover - compiled
    # one pass per lane, each with its k as a literal so the reductions compile to shifts
    out[0] = _range_lane(bits, lo, keys[0, 0], keys[0, 2], keys[0, 3], 69)
    out[1] = _range_lane(bits, lo, keys[1, 0], keys[1, 2], keys[1, 3], 99)
    out[2] = _range_lane(bits, lo, keys[2, 0], keys[2, 2], keys[2, 3], 105)
    out[3] = _range_lane(bits, lo, keys[3, 0], keys[3, 2], keys[3, 3], 159)


@compiled
def _indexed_lane(bits, indices, a, a_hi, g, b, k):  # pragma: no cover - compiled
    s = np.int64(0)
    for j in range(bits.size):
        i = indices[j]
        w = (np.int64(bits[j]) & 0xFFFF) + 1
        hi = (i >> 31) & _LOW32  # i < 2^50
        x = (a & _LOW32) * (i & _LOW31) + (a_hi & _LOW32) * hi + g + (b & _LOW32) * w
        s += _cube(_fold(x, k), k)
    return s


@compiled
def _indexed_sums(bits, indices, keys, out):  # pragma: no cover - compiled
    out[0] = _indexed_lane(bits, indices, keys[0, 0], keys[0, 1], keys[0, 2], keys[0, 3], 69)
    out[1] = _indexed_lane(bits, indices, keys[1, 0], keys[1, 1], keys[1, 2], keys[1, 3], 99)
    out[2] = _indexed_lane(bits, indices, keys[2, 0], keys[2, 1], keys[2, 2], keys[2, 3], 105)
    out[3] = _indexed_lane(bits, indices, keys[3, 0], keys[3, 1], keys[3, 2], keys[3, 3], 159)


@compiled
def _moved_lane(indices, new, old, a, a_hi, g, b, k):  # pragma: no cover - compiled
    """Sum of h(new) - h(old) at the same indices: the index part is computed once."""
    s = np.int64(0)
    for j in range(indices.size):
        i = indices[j]
        hi = (i >> 31) & _LOW32
        base = _fold((a & _LOW32) * (i & _LOW31) + (a_hi & _LOW32) * hi + g, k)
        w_new = (np.int64(new[j]) & 0xFFFF) + 1
        w_old = (np.int64(old[j]) & 0xFFFF) + 1
        s += _cube(_fold(base + (b & _LOW32) * w_new, k), k)
        s -= _cube(_fold(base + (b & _LOW32) * w_old, k), k)
    return s


@compiled
def _moved_sums(indices, new, old, keys, out):  # pragma: no cover - compiled
    out[0] = _moved_lane(indices, new, old, keys[0, 0], keys[0, 1], keys[0, 2], keys[0, 3], 69)
    out[1] = _moved_lane(indices, new, old, keys[1, 0], keys[1, 1], keys[1, 2], keys[1, 3], 99)
    out[2] = _moved_lane(indices, new, old, keys[2, 0], keys[2, 1], keys[2, 2], keys[2, 3], 105)
    out[3] = _moved_lane(indices, new, old, keys[3, 0], keys[3, 1], keys[3, 2], keys[3, 3], 159)


def _keys(name: str) -> np.ndarray:
    return np.array(tensor_keys(name), dtype=np.int64)


def _bits(values: torch.Tensor) -> np.ndarray:
    flat = values.detach().reshape(-1)
    if flat.dtype != torch.bfloat16:
        raise TypeError(f"state digests hash bf16 bit patterns, found {flat.dtype}")
    return flat.contiguous().view(torch.int16).numpy()


def _range_task(name: str, bits: np.ndarray, start: int) -> StateDigest:
    """`bits` at global indices start.. (split where the index crosses a multiple of 2^31)."""
    keys = _keys(name)
    out = np.zeros(4, np.int64)
    sums = [0, 0, 0, 0]
    pos = 0
    while pos < bits.size:
        hi, lo = divmod(start + pos, 1 << 31)
        count = min(bits.size - pos, (1 << 31) - lo)
        chunk_keys = keys.copy()
        for lane, p in enumerate(PRIMES):  # the constant a_hi * hi joins g
            chunk_keys[lane, 2] = (int(keys[lane, 2]) + int(keys[lane, 1]) * hi) % p
        _range_sums(bits[pos : pos + count], lo, chunk_keys, out)
        sums = [s + int(v) for s, v in zip(sums, out, strict=True)]
        pos += count
    return StateDigest.of(sums)


def tensor_sum(name: str, tensor: torch.Tensor, *, start: int = 0) -> StateDigest:
    """The digest of a bf16 tensor's elements, the first at global flat index `start` (a row
    shard of a bigger tensor passes its offset). CPU tensors use the compiled kernels; others
    `device_sum` on their own device."""
    if tensor.device.type != "cpu":
        return device_sum(name, tensor, start=start)
    return _range_task(name, _bits(tensor), start)


def indexed_sum(name: str, indices: torch.Tensor, values: torch.Tensor) -> StateDigest:
    """The digest of elements at arbitrary global flat `indices` (int64, below 2^50 as every
    tensor is) with bf16 `values`."""
    if values.device.type != "cpu":
        return device_sum(name, values, index=indices)
    idx = indices.detach().reshape(-1).to(torch.int64).contiguous().numpy()
    bits = _bits(values)
    if idx.size != bits.size:
        raise ValueError(f"{idx.size} indices for {bits.size} values")
    out = np.zeros(4, np.int64)
    sums = [0, 0, 0, 0]
    for pos in range(0, bits.size, 1 << 30):  # keeps the int64 accumulators from overflowing
        _indexed_sums(bits[pos : pos + (1 << 30)], idx[pos : pos + (1 << 30)], _keys(name), out)
        sums = [s + int(v) for s, v in zip(sums, out, strict=True)]
    return StateDigest.of(sums)


def change_sum(name: str, change: TensorChange) -> StateDigest:
    """How one tensor's digest moves under a change: new values in, previous values out (one
    compiled pass for CPU tensors)."""
    if change.values.device.type != "cpu":
        return indexed_sum(name, change.indices, change.values) - indexed_sum(
            name, change.indices, change.previous
        )
    idx = change.indices.reshape(-1).to(torch.int64).contiguous().numpy()
    new, old = _bits(change.values), _bits(change.previous)
    if not idx.size == new.size == old.size:
        raise ValueError(f"{idx.size} indices for {new.size} values, {old.size} previous")
    out = np.zeros(4, np.int64)
    sums = [0, 0, 0, 0]
    for pos in range(0, idx.size, 1 << 29):  # keeps the signed accumulators in range
        part = slice(pos, pos + (1 << 29))
        _moved_sums(idx[part], new[part], old[part], _keys(name), out)
        sums = [s + int(v) for s, v in zip(sums, out, strict=True)]
    return StateDigest.of(sums)


def apply_changes(
    sums: Mapping[str, StateDigest], changes: Mapping[str, TensorChange]
) -> dict[str, StateDigest]:
    """Per-tensor digests after `changes`, in O(changed elements) (a small thread pool)."""
    with ThreadPoolExecutor(WORKERS) as pool:
        moved = dict(zip(changes, pool.map(change_sum, changes, changes.values()), strict=True))
    return {name: s + moved[name] if name in moved else s for name, s in sums.items()}


def state_sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, StateDigest]:
    """Every tensor's digest over all its elements (a full recompute), chunked over threads."""
    tasks = []
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            tasks.append((name, None, tensor, 0))
            continue
        bits = _bits(tensor)
        for start in range(0, bits.size, _CHUNK):
            tasks.append((name, bits[start : start + _CHUNK], None, start))

    def run(task: tuple) -> StateDigest:
        name, bits, tensor, start = task
        return _range_task(name, bits, start) if tensor is None else device_sum(name, tensor)

    with ThreadPoolExecutor(WORKERS) as pool:
        parts = list(pool.map(run, tasks))
    out: dict[str, list[StateDigest]] = {name: [] for name in tensors}
    for (name, *_), part in zip(tasks, parts, strict=True):
        out[name].append(part)
    return {name: total(found) for name, found in out.items()}


def device_sum(
    name: str,
    values: torch.Tensor,
    *,
    start: int = 0,
    index: torch.Tensor | None = None,
    chunk: int = _DEVICE_CHUNK,
) -> StateDigest:
    """The digest with int64 tensor ops on `values`' own device (no host copy of the values).

    Elements are taken in row-major order of `values`; their global flat indices are
    `start + position`, or `index` (same number of elements, moved to the device a chunk at a
    time), which is how a slice that is not a contiguous range of the full tensor (a column
    shard, a vocab shard with padding removed) names its elements. Bit-identical to the
    compiled CPU kernels.

    It runs `chunk` elements at a time (at most 2^22): on a serving GPU this memory is outside
    vLLM's budget, and each chunk holds about 120 B per element (three (4, chunk) int64
    buffers and three (chunk,) ones), about 120 MiB at the default 2^20 (a non-contiguous
    `values` is first copied whole: 2 B per element). The lanes' constants are built once per
    device (`_lane_constants`, `_lane_keys`), not per chunk or call.
    """
    if not 0 < chunk <= _MAX_DEVICE_CHUNK:
        raise ValueError(f"chunk must be in 1..{_MAX_DEVICE_CHUNK}, got {chunk}")
    device = values.device
    flat = values.detach().reshape(-1)
    if flat.dtype != torch.bfloat16:
        raise TypeError(f"state digests hash bf16 bit patterns, found {flat.dtype}")
    if index is not None:
        index = index.detach().reshape(-1)
        if index.numel() != flat.numel():
            raise ValueError(f"{index.numel()} indices for {flat.numel()} values")
    keys = _lane_keys(name, device)
    k, primes = _lane_constants(device)
    sums = torch.zeros(4, dtype=torch.int64, device=device)
    for pos in range(0, flat.numel(), chunk):
        bits = flat[pos : pos + chunk]
        if index is None:
            at = start + pos
            i = torch.arange(at, at + bits.numel(), dtype=torch.int64, device=device)
        else:
            i = index[pos : pos + chunk].to(device=device, dtype=torch.int64)
        sums += _chunk_sums(bits, i, keys, k)
        sums %= primes
    return StateDigest.of(sums.tolist())


@functools.cache  # one entry per device
def _lane_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each lane's k (4, 1) and prime (4,) on `device`: uploaded once, not every chunk."""
    k = torch.tensor(LANE_K, dtype=torch.int64, device=device).unsqueeze(1)
    return k, torch.tensor(PRIMES, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=1 << 16)  # as `tensor_keys`; one 128 B tensor per name and device
def _lane_keys(name: str, device: torch.device) -> torch.Tensor:
    """A tensor's keys (4 lanes x (a, a_hi, g, b)) on `device`, uploaded once, not at every
    digest pass (each calls `device_sum` once per tensor)."""
    return torch.tensor(tensor_keys(name), dtype=torch.int64, device=device)


def _chunk_sums(
    bits: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, k: torch.Tensor
) -> torch.Tensor:
    """Per-lane sums (4,) of h over one chunk: bf16 `bits` at int64 global `index` (not
    modified). In place where it can, so at most three (4, n) int64 buffers are live."""
    w = bits.view(torch.int16).to(torch.int64)
    w &= 0xFFFF
    w += 1
    x = keys[:, 1:2] * (index >> 31)  # a_hi * (i div 2^31)
    t = keys[:, 0:1] * (index & _LOW31)
    x += t
    torch.mul(keys[:, 3:4], w, out=t)
    x += t
    x += keys[:, 2:3]
    scratch = torch.empty_like(x)
    _fold_(x, k, scratch)
    torch.mul(x, x, out=t)
    _fold_(t, k, scratch)
    t *= x
    _fold_(t, k, scratch)
    return t.sum(dim=1)


def _fold_(x: torch.Tensor, k: torch.Tensor, scratch: torch.Tensor) -> None:
    """`_fold` in place: x < 2^63 -> below 2^31 + (2k+1)k, the same mod p."""
    for _ in range(2):
        torch.bitwise_right_shift(x, 31, out=scratch)
        scratch *= k
        x &= _LOW31
        x += scratch


def full_state_digest(tensors: Mapping[str, torch.Tensor]) -> StateDigest:
    """The digest of a whole state in one pass (what a file written after it must carry)."""
    return total(state_sums(tensors))
