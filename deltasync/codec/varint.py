"""Vectorised LEB128 and zigzag: the integer layer under the `packed` encoding."""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

__all__ = ["leb128_decode", "leb128_encode", "zigzag_decode16", "zigzag_encode16"]

_MAX_BYTES = 10  # enough for any uint64


def leb128_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 bytes of non-negative integers, 7 bits per byte, low groups first."""
    v = values.astype(np.uint64, copy=False)
    if v.size == 0:
        return np.empty(0, np.uint8)
    if int(v.max()) < 0x80:
        return v.astype(np.uint8)
    nbytes = np.ones(v.size, np.int64)
    for k in range(1, _MAX_BYTES):
        nbytes += v >= np.uint64(1 << (7 * k))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), np.uint8)
    for k in range(int(nbytes.max())):
        sel = np.flatnonzero(nbytes > k) if k else slice(None)
        chunk = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + k] = (chunk | more).astype(np.uint8)
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
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if int(lengths.max()) > _MAX_BYTES:
            raise FormatError("varint longer than 10 bytes")
        position = np.arange(data.size) - np.repeat(starts, lengths)
        parts = (data & 0x7F).astype(np.uint64) << (np.uint64(7) * position.astype(np.uint64))
        out = np.bitwise_or.reduceat(parts, starts)
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
