"""LEB128 and zigzag: the integer layer under the `packed` encoding.

Encoding is the trainer's hot path, so it is a compiled (numba) loop that also does the
arithmetic before it: index gaps, and zigzag of the bit-pattern step, in the same pass. Decoding
reads untrusted bytes and stays vectorised numpy: sparse-delta integers are almost all below 128
(one byte), so it does one pass over everything and further passes only over the few multi-byte
integers.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..jit import compiled

__all__ = ["gap_varints", "leb128_decode", "step_varints", "zigzag_decode16"]

_MAX_BYTES = 10  # enough for any uint64
_STEP_BYTES = 3  # a zigzag int16 is below 2**16 < 2**21


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


def leb128_decode(data: np.ndarray, count: int, *, limit: int) -> np.ndarray:
    """Decode exactly `count` integers, each < `limit`, from LEB128 bytes (uint64 result).

    Raises `FormatError` on a wrong count, an unterminated last integer, an overlong encoding or a
    value at or past `limit`, before allocating anything proportional to a hostile count.
    """
    data = np.asarray(data, np.uint8)
    terminators = data < 0x80
    found = int(np.count_nonzero(terminators))
    if found != count or (count and not terminators[-1]):
        raise FormatError(f"varint stream holds {found} integers, expected {count}")
    if found == data.size:
        out = data.astype(np.uint64)
    else:
        ends = np.flatnonzero(terminators)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        multi = np.flatnonzero(lengths > 1)
        if int(lengths[multi].max()) > _MAX_BYTES:
            raise FormatError("varint longer than 10 bytes")
        out = (data[starts] & 0x7F).astype(np.uint64)
        for k in range(1, int(lengths[multi].max())):
            multi = multi[lengths[multi] > k]
            part = (data[starts[multi] + k] & 0x7F).astype(np.uint64)
            out[multi] |= part << np.uint64(7 * k)
    if out.size and int(out.max()) >= limit:
        raise FormatError(f"varint value {int(out.max())} out of range (limit {limit})")
    return out


def zigzag_decode16(codes: np.ndarray) -> np.ndarray:
    """uint16 codes -> int16: 0, -1, 1, -2, ... for 0, 1, 2, 3, ..."""
    z = codes.astype(np.int32)
    return ((z >> 1) ^ -(z & 1)).astype(np.int16)
