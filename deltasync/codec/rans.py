"""Integer streams under a static rANS coder: the entropy layer of the `ans` encoding.

One stream codes a sequence of non-negative integers. Each integer is split into raw low bits
(`raw_bits` of them, a Rice-style split: the low bits of a geometric gap are close to uniform)
and the integer above them, which is coded by rANS as a symbol of a small alphabet against a
frequency table stored in the stream: itself when below `DIRECT`, else an escape symbol naming
its bit length, whose bits under the top bit follow the raw low bits. So a stream costs the
empirical entropy of its symbols plus the raw bits: index gaps reach the entropy of the index
set, bf16 value steps (80 % of them one step of the bit pattern) the entropy of their
distribution.

The byte layout of a stream: bucket_layout.md, "Delta, `encoding=ans`".

Both directions are single compiled passes. Decoding reads untrusted bytes: the header is
parsed with bounds checks, the table must sum to 2**PROB_BITS, every read is bounds-checked in
the loop, and a stream must end exactly where its coder began (initial state, every byte used),
so a truncated, extended or reordered stream is refused rather than misread. Raw bits carry no
redundancy: a flipped raw bit decodes to another integer, which the file's digests catch.
"""

from __future__ import annotations

import numpy as np

from deltasync.errors import FormatError
from deltasync.kernels.jit import compiled

__all__ = [
    "ALPHABET",
    "PROB_BITS",
    "decode_gaps",
    "decode_integers",
    "encode_gaps",
    "encode_integers",
]

PROB_BITS = 14
_M = 1 << PROB_BITS
_L = 1 << 15  # rANS state in [2**15, 2**31), renormalised by 16-bit words: below 2**31,
# the reciprocal division of the encoder (ryg_rans') is exact
DIRECT = 32  # integers (above the raw bits) below this are their own symbol
MAX_BITS = 57  # every integer of a stream is below 2**57
MAX_RAW_BITS = 40
ALPHABET = DIRECT + MAX_BITS - 5  # escapes for bit lengths 6 .. MAX_BITS
_OK, _TRUNCATED, _TRAILING, _OVERFLOW, _BAD_HEADER, _BAD_TABLE, _PAST_END = range(7)
_PROBLEMS = {
    _TRUNCATED: "ends early",
    _TRAILING: "does not end where its coder began (altered, reordered or trailing bytes)",
    _OVERFLOW: "holds an integer too large",
    _BAD_HEADER: "has a malformed header",
    _BAD_TABLE: f"has a frequency table that does not sum to 2**{PROB_BITS}",
    _PAST_END: "leads past the tensor's last element",
}


@compiled
def _bit_length(v):  # pragma: no cover - compiled
    n = 0
    while v:
        n += 1
        v >>= np.uint64(1)
    return n


@compiled
def _put_leb128(out, p, v):  # pragma: no cover - compiled
    v = np.uint64(v)
    while v >= 0x80:
        out[p] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        p += 1
    out[p] = np.uint8(v)
    return p + 1


@compiled
def _quantize(counts, total, freq):  # pragma: no cover - compiled
    """Frequencies summing to 2**PROB_BITS, every present symbol at least 1."""
    acc = 0
    for s in range(counts.size):
        if counts[s]:
            freq[s] = max(1, counts[s] * _M // total)
            acc += freq[s]
    excess = acc - _M
    order = np.argsort(-freq)
    if excess < 0:
        freq[order[0]] -= excess
    i = 0
    while excess > 0:  # symbols bumped to 1: take the rounding error from the largest ones
        s = order[i % order.size]
        step = min(excess, freq[s] - 1)
        if step > 0:
            freq[s] -= step
            excess -= step
        i += 1


@compiled
def _put(x, s, x_max, rcp, rcp_shift, bias, cmpl, words, w):  # pragma: no cover - compiled
    """One rANS encode step of symbol `s` on state `x`: (new state, next free word)."""
    if x >= x_max[s]:
        w -= 1
        words[w] = np.uint16(x & np.uint64(0xFFFF))
        x >>= np.uint64(16)
    q = ((x * rcp[s]) >> np.uint64(32)) >> rcp_shift[s]
    return x + bias[s] + q * cmpl[s], w


@compiled
def _value(values, i, gaps):  # pragma: no cover - compiled
    """Integer i of the stream: values[i], or with `gaps` the gap before values[i] (a negative
    one wraps to 2**64 - k, which the encoder refuses)."""
    if gaps:
        return np.uint64(np.int64(values[i]) - (np.int64(values[i - 1]) if i else -1) - 1)
    return np.uint64(values[i])


@compiled
def _encode_stream(values, raw_bits, gaps):  # pragma: no cover - compiled
    """The stream of `values` (integers in [0, 2**57); with `gaps`, of the gaps between
    ascending `values`) as uint8; empty when an integer is out of range."""
    n = values.size
    symbols = np.empty(n, np.uint8)
    lanes = np.zeros((4, ALPHABET), np.int64)  # four histograms: no chain through one counter
    extra = 0
    for i in range(n):
        v = _value(values, i, gaps)
        if v >> np.uint64(MAX_BITS):
            return np.empty(0, np.uint8)
        high = v >> np.uint64(raw_bits)
        if high < DIRECT:
            s = np.uint8(high)
        else:
            length = _bit_length(high)
            s = np.uint8(DIRECT + length - 6)
            extra += length - 1
        symbols[i] = s
        lanes[i & 3, s] += 1
    counts = lanes.sum(axis=0)
    freq = np.zeros(ALPHABET, np.int64)
    size = 0
    if n:
        _quantize(counts, n, freq)
        for s in range(ALPHABET):
            if freq[s]:
                size = s + 1
    raw_len = (n * raw_bits + extra + 7) // 8
    out = np.empty(1 + 10 + 3 * size + 10 + raw_len + 2 * (n + 4), np.uint8)
    out[0] = np.uint8(raw_bits)
    p = _put_leb128(out, 1, size)
    for s in range(size):
        p = _put_leb128(out, p, freq[s])
    p = _put_leb128(out, p, raw_len)
    # raw bits: the low bits of every integer, then the escape bits under its top bit
    acc = np.uint64(0)
    filled = 0
    low_mask = (np.uint64(1) << np.uint64(raw_bits)) - np.uint64(1)
    for i in range(n):
        v = _value(values, i, gaps)
        acc |= (v & low_mask) << np.uint64(filled)
        filled += raw_bits
        while filled >= 8:
            out[p] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            filled -= 8
            p += 1
        s = symbols[i]
        if s >= DIRECT:
            bits = s - DIRECT + 5
            field = (v >> np.uint64(raw_bits)) & ((np.uint64(1) << np.uint64(bits)) - np.uint64(1))
            acc |= field << np.uint64(filled)
            filled += bits
            while filled >= 8:
                out[p] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                filled -= 8
                p += 1
    if filled:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
    if n == 0:
        return out[:p]
    # per symbol: x // freq as a multiply and shift (ryg_rans' reciprocal), and the bias that
    # turns x into (x // freq) << PROB_BITS + x % freq + cum
    rcp = np.zeros(ALPHABET, np.uint64)
    rcp_shift = np.zeros(ALPHABET, np.uint64)
    bias = np.zeros(ALPHABET, np.uint64)
    x_max = np.zeros(ALPHABET, np.uint64)  # renormalise before coding when x reaches it
    cmpl = np.zeros(ALPHABET, np.uint64)
    start = 0
    for s in range(ALPHABET):
        f = freq[s]
        x_max[s] = np.uint64(((_L >> PROB_BITS) << 16) * f)
        cmpl[s] = np.uint64(_M - f)
        if f == 1:
            rcp[s] = np.uint64(0xFFFFFFFF)
            bias[s] = np.uint64(start + _M - 1)
        elif f > 1:
            shift = 0
            while (1 << shift) < f:
                shift += 1
            rcp[s] = np.uint64(((1 << (shift + 31)) + f - 1) // f)
            rcp_shift[s] = np.uint64(shift - 1)
            bias[s] = np.uint64(start)
        start += f
    words = np.empty(n + 4, np.uint16)
    x0 = x1 = np.uint64(_L)  # two interleaved coders: integer i is coded by state i % 2
    w = words.size
    i = n - 1  # rANS codes in reverse, so that decoding runs forward
    if n & 1:
        x0, w = _put(x0, symbols[i], x_max, rcp, rcp_shift, bias, cmpl, words, w)
        i -= 1
    while i > 0:
        x1, w = _put(x1, symbols[i], x_max, rcp, rcp_shift, bias, cmpl, words, w)
        x0, w = _put(x0, symbols[i - 1], x_max, rcp, rcp_shift, bias, cmpl, words, w)
        i -= 2
    for x in (x1, x0):  # the decoder reads state 0, then state 1
        w -= 1
        words[w] = np.uint16(x >> np.uint64(16))
        w -= 1
        words[w] = np.uint16(x & np.uint64(0xFFFF))
    for j in range(w, words.size):
        word = words[j]
        out[p] = np.uint8(word & 0xFF)
        out[p + 1] = np.uint8(word >> 8)
        p += 2
    return out[:p]


@compiled
def _get_leb128(data, p):  # pragma: no cover - compiled
    """(value, next position); position -1 when truncated or longer than 9 bytes."""
    value = np.uint64(0)
    shift = 0
    while True:
        if p >= data.size or shift > 56:
            return np.uint64(0), -1
        byte = np.uint64(data[p])
        p += 1
        value |= (byte & np.uint64(0x7F)) << np.uint64(shift)
        if byte < 0x80:
            return value, p
        shift += 7


@compiled
def _u32(data, p):  # pragma: no cover - compiled
    return (
        np.uint32(data[p])
        | (np.uint32(data[p + 1]) << np.uint32(8))
        | (np.uint32(data[p + 2]) << np.uint32(16))
        | (np.uint32(data[p + 3]) << np.uint32(24))
    )


@compiled
def _take(x, data, w, freq, cum, lut):  # pragma: no cover - compiled
    """One rANS decode step on state `x`: (new state, symbol, next word); word -1 past the end."""
    slot = x & np.uint32(_M - 1)
    s = lut[slot]
    x = freq[s] * (x >> np.uint32(PROB_BITS)) + slot - cum[s]
    if x < _L:
        if w + 2 > data.size:
            return x, s, -1
        x = (x << np.uint32(16)) | np.uint32(data[w]) | (np.uint32(data[w + 1]) << np.uint32(8))
        w += 2
    return x, s, w


@compiled
def _decode_stream(data, count, out, limit):  # pragma: no cover - compiled
    """Decode `count` integers into `out`; with `limit` > 0 they are gaps, and `out` receives
    the ascending positions they lead to, each below `limit`. Returns a status."""
    if data.size < 1:
        return _TRUNCATED
    raw_bits = np.int64(data[0])
    if raw_bits > MAX_RAW_BITS:
        return _BAD_HEADER
    size, p = _get_leb128(data, 1)
    if p < 0 or size < 1 or size > ALPHABET:
        return _BAD_HEADER
    freq = np.zeros(ALPHABET, np.int64)
    total = 0
    for s in range(size):
        f, p = _get_leb128(data, p)
        if p < 0 or f > _M:
            return _BAD_HEADER
        freq[s] = np.int64(f)
        total += freq[s]
    if total != _M:
        return _BAD_TABLE
    raw_len, p = _get_leb128(data, p)
    if p < 0 or raw_len > np.uint64(data.size - p):
        return _BAD_HEADER
    raw_end = p + np.int64(raw_len)
    rest = data.size - raw_end
    if rest % 2 or rest < 8 or rest // 2 > count + 4:
        return _BAD_HEADER
    freq32 = np.zeros(ALPHABET, np.uint32)
    cum = np.zeros(ALPHABET, np.uint32)
    lut = np.empty(_M, np.uint8)  # slot -> symbol: 16 KiB, in L1
    start = 0
    for s in range(ALPHABET):
        freq32[s] = np.uint32(freq[s])
        cum[s] = np.uint32(start)
        lut[start : start + freq[s]] = s
        start += freq[s]
    freq = freq32
    w = raw_end
    x0 = _u32(data, w)
    x1 = _u32(data, w + 4)
    w += 8
    r = p
    acc = np.uint64(0)
    filled = 0
    position = np.int64(-1)
    for i in range(count):
        if i & 1:
            x1, s, w = _take(x1, data, w, freq, cum, lut)
        else:
            x0, s, w = _take(x0, data, w, freq, cum, lut)
        if w < 0:
            return _TRUNCATED
        low = np.uint64(0)
        if raw_bits:
            while filled < raw_bits:
                if r == raw_end:
                    return _TRUNCATED
                acc |= np.uint64(data[r]) << np.uint64(filled)
                r += 1
                filled += 8
            low = acc & ((np.uint64(1) << np.uint64(raw_bits)) - np.uint64(1))
            acc >>= np.uint64(raw_bits)
            filled -= raw_bits
        if s < DIRECT:
            high = np.uint64(s)
        else:
            bits = s - DIRECT + 5  # the bit length less its top bit
            if raw_bits + bits + 1 > MAX_BITS:
                return _OVERFLOW
            while filled < bits:
                if r == raw_end:
                    return _TRUNCATED
                acc |= np.uint64(data[r]) << np.uint64(filled)
                r += 1
                filled += 8
            high = (np.uint64(1) << np.uint64(bits)) | (
                acc & ((np.uint64(1) << np.uint64(bits)) - np.uint64(1))
            )
            acc >>= np.uint64(bits)
            filled -= bits
        value = np.int64((high << np.uint64(raw_bits)) | low)
        if limit > 0:
            position += value + 1  # each gap < 2**57 and position < limit: no overflow
            if position >= limit:
                return _PAST_END
            value = position
        out[i] = value
    if x0 != _L or x1 != _L or w != data.size or r != raw_end or acc != 0:
        return _TRAILING
    return _OK


def _checked_raw_bits(raw_bits: int) -> int:
    if not 0 <= raw_bits <= MAX_RAW_BITS:
        raise ValueError(f"raw_bits must lie in 0..{MAX_RAW_BITS}, got {raw_bits}")
    return raw_bits


def _int_array(values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values)
    if values.dtype.kind not in "iu" or values.dtype.itemsize > 8 or values.dtype == np.uint64:
        values = values.astype(np.int64)
    return values


def encode_integers(values: np.ndarray, raw_bits: int) -> np.ndarray:
    """One stream (uint8) holding `values` (integers in [0, 2**57)), `raw_bits` low bits raw."""
    stream = _encode_stream(_int_array(values), _checked_raw_bits(raw_bits), False)
    if not stream.size:
        raise ValueError(f"integers must lie in [0, 2**{MAX_BITS})")
    return stream


def encode_gaps(indices: np.ndarray, raw_bits: int) -> np.ndarray:
    """The stream of the gaps `index[i] - index[i-1] - 1` (index[-1] = -1) of strictly ascending
    non-negative `indices`, computed in the coder's own pass."""
    stream = _encode_stream(_int_array(indices), _checked_raw_bits(raw_bits), True)
    if not stream.size:
        raise ValueError("indices must be strictly ascending, from 0, below 2**57")
    return stream


def _decode(data: np.ndarray | bytes, count: int, what: str, limit: int) -> np.ndarray:
    data = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data)
    if count == 0:  # an empty stream: the header alone
        if data.size > 4 or (data.size and data[0] > MAX_RAW_BITS):
            raise FormatError(f"{what}: {data.size} bytes for no integers")
        return np.zeros(0, np.int64)
    out = np.empty(count, np.int64)
    status = _decode_stream(data, count, out, limit)
    if status != _OK:
        raise FormatError(f"{what}: the stream {_PROBLEMS[status]}")
    return out


def decode_integers(data: np.ndarray | bytes, count: int, what: str) -> np.ndarray:
    """The `count` integers of a stream `encode_integers` wrote (`FormatError` otherwise)."""
    return _decode(data, count, what, 0)


def decode_gaps(data: np.ndarray | bytes, count: int, numel: int, what: str) -> np.ndarray:
    """The `count` ascending indices, each below `numel`, of a stream `encode_gaps` wrote."""
    if numel < 1:
        if count:
            raise FormatError(f"{what}: {count} indices into an empty tensor")
        numel = 1
    return _decode(data, count, what, numel)
