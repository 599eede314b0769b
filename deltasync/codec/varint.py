"""Vectorised LEB128 and zigzag: the integer layer under the `packed` encoding.

Sparse-delta integers are almost all below 128 (one byte), so both directions do one pass over
everything and further passes only over the few multi-byte integers.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

__all__ = ["leb128_decode", "leb128_encode", "zigzag_decode16", "zigzag_encode16"]

_MAX_BYTES = 10  # enough for any uint64
_LOW7 = np.uint64(0x7F)


def leb128_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 bytes of non-negative integers, 7 bits per byte, low groups first."""
    v = values.astype(np.uint64, copy=False)
    big = np.flatnonzero(v >= 0x80)
    if big.size == 0:
        return v.astype(np.uint8)
    nbytes = np.ones(v.size, np.int64)
    multi, k = big, 1
    while multi.size:
        nbytes[multi] += 1
        k += 1
        multi = multi[v[multi] >= np.uint64(1 << (7 * k))] if k < _MAX_BYTES else multi[:0]
    starts = np.cumsum(nbytes) - nbytes
    out = np.zeros(int(starts[-1] + nbytes[-1]), np.uint8)
    out[starts] = (v & _LOW7).astype(np.uint8)
    out[starts[big]] |= 0x80
    for k in range(1, int(nbytes[big].max())):
        sel = big[nbytes[big] > k]
        chunk = ((v[sel] >> np.uint64(7 * k)) & _LOW7).astype(np.uint8)
        out[starts[sel] + k] = chunk | np.where(nbytes[sel] > k + 1, 0x80, 0).astype(np.uint8)
    return out


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


def zigzag_encode16(diff: np.ndarray) -> np.ndarray:
    """int16 -> uint16 so that small magnitudes of either sign give small codes."""
    d = diff.astype(np.int16, copy=False)
    return ((d.astype(np.int32) << 1) ^ (d.astype(np.int32) >> 15)).astype(np.uint16)


def zigzag_decode16(codes: np.ndarray) -> np.ndarray:
    z = codes.astype(np.int32)
    return ((z >> 1) ^ -(z & 1)).astype(np.int16)
