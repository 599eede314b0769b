"""LEB128 and zigzag: the integer layer under the `packed` encoding.

Both directions are compiled (numba) loops that fuse the arithmetic around the varints into the
same pass: encoding takes index gaps and the zigzag of each bit-pattern step; decoding rebuilds
the indices and, reading the base at those indices, the new bits. Decoding reads untrusted
bytes: every varint is bounds-checked in the loop, and the stream's integer count is checked
(one vectorised pass) before anything proportional to the claimed count is allocated.
"""

from __future__ import annotations

import numpy as np

from deltasync.errors import FormatError
from deltasync.kernels.jit import compiled

__all__ = ["gap_varints", "indices_from_gaps", "step_varints", "values_from_steps"]

_MAX_BYTES = 10  # enough for any uint64
_STEP_BYTES = 3  # a zigzag int16 is below 2**16 < 2**21
_PAYLOAD_BITS = 56  # no tensor has 2**56 elements: a varint past this is out of range
# statuses of the compiled decoders
_OK, _OVERLONG, _OUT_OF_RANGE, _MISCOUNTED = 0, 1, 2, 3


@compiled
def _gaps_into(indices, out):  # pragma: no cover - compiled
    p = 0
    previous = -1
    for index in indices:
        v = np.uint64(index - previous - 1)
        previous = index
        while v >= 0x80:
            out[p] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
            v >>= np.uint64(7)
            p += 1
        out[p] = np.uint8(v)
        p += 1
    return p


@compiled
def _steps_into(new_bits, old_bits, out):  # pragma: no cover - compiled
    p = 0
    for i in range(new_bits.size):
        step = np.int16(np.int64(new_bits[i]) - np.int64(old_bits[i]))  # wraps modulo 2**16
        v = (np.int64(step) << 1) ^ (np.int64(step) >> 15)
        while v >= 0x80:
            out[p] = np.uint8((v & 0x7F) | 0x80)
            v >>= 7
            p += 1
        out[p] = np.uint8(v)
        p += 1
    return p


def gap_varints(indices: np.ndarray) -> np.ndarray:
    """LEB128 bytes of `index[i] - index[i-1] - 1` (index[-1] = -1) for ascending int64 indices."""
    indices = np.ascontiguousarray(indices, np.int64)
    out = np.empty(indices.size * _MAX_BYTES, np.uint8)
    return out[: _gaps_into(indices, out)].copy()


def step_varints(new_bits: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
    """LEB128 bytes of zigzag(int16(new - old)): the bit-pattern step of each changed value."""
    new_bits = np.ascontiguousarray(new_bits, np.int16)
    old_bits = np.ascontiguousarray(old_bits, np.int16)
    if new_bits.shape != old_bits.shape:
        raise ValueError("step_varints needs equally many new and old values")
    out = np.empty(new_bits.size * _STEP_BYTES, np.uint8)
    return out[: _steps_into(new_bits, old_bits, out)].copy()


@compiled
def _read_varints(data, limit, out):  # pragma: no cover - compiled
    """Decode LEB128 integers, each < `limit`, into `out`; returns (status, integers decoded)."""
    n = data.size
    p = 0
    k = 0
    while p < n:
        if k == out.size:
            return _MISCOUNTED, k
        value = 0
        shift = 0
        while True:
            if p == n:
                return _MISCOUNTED, k  # unterminated last integer
            byte = np.int64(data[p])
            p += 1
            if shift < _PAYLOAD_BITS:
                value |= (byte & 0x7F) << shift
            elif byte & 0x7F:
                return _OUT_OF_RANGE, k
            if byte < 0x80:
                break
            shift += 7
            if shift >= 7 * _MAX_BYTES:
                return _OVERLONG, k
        if value >= limit:
            return _OUT_OF_RANGE, k
        out[k] = value
        k += 1
    return (_OK if k == out.size else _MISCOUNTED), k


@compiled
def _gaps_to_indices(gaps, numel):  # pragma: no cover - compiled
    """Indices from gaps in place; False when they run past `numel`."""
    position = -1
    for k in range(gaps.size):
        position += gaps[k] + 1
        if position >= numel:
            return False
        gaps[k] = position
    return True


@compiled
def _apply_steps(codes, base, indices, previous, values):  # pragma: no cover - compiled
    """previous = base[indices]; values = previous + unzigzag(codes), modulo 2**16."""
    for k in range(codes.size):
        old = base[indices[k]]
        previous[k] = old
        code = codes[k]
        values[k] = np.int16(np.int64(old) + ((code >> 1) ^ -(code & 1)))


def _varints(data: np.ndarray, count: int, limit: int) -> np.ndarray:
    """Exactly `count` LEB128 integers, each < `limit`, as int64 (`FormatError` otherwise)."""
    data = np.ascontiguousarray(data, np.uint8)
    found = int(np.count_nonzero(data < 0x80))
    if found != count or (count and data[-1] >= 0x80):
        raise FormatError(f"varint stream holds {found} integers, expected {count}")
    out = np.empty(count, np.int64)
    status, k = _read_varints(data, limit, out)
    if status != _OK:
        problem = {
            _OVERLONG: f"is longer than {_MAX_BYTES} bytes",
            _OUT_OF_RANGE: f"is out of range (limit {limit})",
            _MISCOUNTED: f"is past the {count} expected",
        }[status]
        raise FormatError(f"varint {k} {problem}")
    return out


def indices_from_gaps(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The `count` ascending int64 indices that `gap_varints` encoded, all below `numel`."""
    indices = _varints(data, count, max(numel, 1))
    if not _gaps_to_indices(indices, numel):
        raise FormatError(f"indices run past the tensor's {numel} elements")
    return indices


def values_from_steps(
    data: np.ndarray,
    base: np.ndarray,
    indices: np.ndarray,
    *,
    count: int | None = None,
    kept: np.ndarray | slice | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(previous, new) int16 bits at `indices` of the flat base, from `step_varints` bytes.

    With `kept` (a slice or mask over the stream's `count` values), only those values are
    rebuilt, at `indices` (one per kept value): a worker holding a slice of the tensor.
    """
    codes = _varints(data, indices.size if count is None else count, 1 << 16)
    if kept is not None:
        codes = np.ascontiguousarray(codes[kept])
    previous = np.empty(indices.size, np.int16)
    values = np.empty(indices.size, np.int16)
    _apply_steps(codes, base, indices, previous, values)
    return previous, values
