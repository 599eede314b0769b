"""Integer streams under a static rANS coder: the entropy layer of the `ans` encoding.

One stream codes a sequence of non-negative integers. Each integer is split into a symbol of a
small alphabet, coded by rANS against a frequency table stored in the stream, and raw low bits:
`raw_bits` low bits always (a Rice-style split for index gaps, whose low bits are close to
uniform), then the integer above them as a symbol when below `DIRECT`, or an escape symbol
naming its bit length followed by the bits under its top bit. So a stream costs the empirical
entropy of its symbols plus the raw bits: index gaps reach the entropy of the index set, bf16
value steps (80 % of them one step of the bit pattern) the entropy of their distribution.

Layout (little-endian), see bucket_layout.md:
    u8 raw_bits | LEB128 table size T | T x LEB128 frequency (summing to 2**PROB_BITS)
    | LEB128 byte count of the raw-bit section | raw bits (LSB first) | rANS: u32 state, u16 words

Decoding reads untrusted bytes: the table is checked (size, sum), every read is bounds-checked
in the compiled loops, and a stream must end exactly where its coder began (final state and
every byte consumed), so a truncated or altered stream is refused rather than misread.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..jit import compiled

__all__ = ["decode_integers", "encode_integers"]

PROB_BITS = 14
_M = 1 << PROB_BITS
_L = 1 << 16  # rANS state lower bound; the state is 32 bits, renormalised by 16-bit words
DIRECT = 32  # integers (above the raw bits) below this are their own symbol
_MAX_BITS = 57  # bit length of the largest integer a stream can hold (< 2**57)
ALPHABET = DIRECT + _MAX_BITS - 5  # escapes for bit lengths 6 .. _MAX_BITS
_OK, _TRUNCATED, _BAD_SYMBOL, _TRAILING, _OVERFLOW = 0, 1, 2, 3, 4


@compiled
def _symbols(values, raw_bits, symbols, counts):  # pragma: no cover - compiled
    """Symbol of each integer (above its raw bits), counted; returns the escape bits needed."""
    extra = 0
    for i in range(values.size):
        high = np.uint64(values[i]) >> np.uint64(raw_bits)
        if high < DIRECT:
            s = np.int32(high)
        else:
            length = 0
            v = high
            while v:
                length += 1
                v >>= np.uint64(1)
            s = np.int32(DIRECT + length - 6)
            extra += length - 1
        symbols[i] = s
        counts[s] += 1
    return extra


@compiled
def _write_raw(values, raw_bits, symbols, out):  # pragma: no cover - compiled
    """Raw low bits and escape bits of every integer, LSB first; returns bytes written."""
    acc = np.uint64(0)
    filled = 0
    p = 0
    low_mask = (np.uint64(1) << np.uint64(raw_bits)) - np.uint64(1)
    for i in range(values.size):
        v = np.uint64(values[i])
        for part in range(2):
            if part == 0:
                bits, field = raw_bits, v & low_mask
            else:
                s = symbols[i]
                if s < DIRECT:
                    break
                bits = s - DIRECT + 5  # bit length - 1
                field = (v >> np.uint64(raw_bits)) & (
                    (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
                )
            while bits > 0:
                take = min(bits, 64 - filled, 32)
                acc |= (field & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(
                    filled
                )
                field >>= np.uint64(take)
                bits -= take
                filled += take
                while filled >= 8:
                    out[p] = np.uint8(acc & np.uint64(0xFF))
                    acc >>= np.uint64(8)
                    filled -= 8
                    p += 1
    if filled:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
    return p


@compiled
def _rans_encode(symbols, freq, cum, out):  # pragma: no cover - compiled
    """rANS over `symbols` (coded in reverse); `out` receives words from its end. Returns the
    index of the first word written (the state's two words come first)."""
    x = np.uint64(_L)
    p = out.size
    for i in range(symbols.size - 1, -1, -1):
        s = symbols[i]
        f = np.uint64(freq[s])
        x_max = np.uint64((_L >> PROB_BITS) << 16) * f
        if x >= x_max:
            p -= 1
            out[p] = np.uint16(x & np.uint64(0xFFFF))
            x >>= np.uint64(16)
        x = (x // f << np.uint64(PROB_BITS)) + x % f + np.uint64(cum[s])
    p -= 1
    out[p] = np.uint16(x >> np.uint64(16))
    p -= 1
    out[p] = np.uint16(x & np.uint64(0xFFFF))
    return p


@compiled
def _take(raw, r, acc, filled, bits):  # pragma: no cover - compiled
    """`bits` (<= 56) raw bits: (value, r, acc, filled), r = -1 when the section ends early."""
    while filled < bits:
        if r == raw.size:
            return np.uint64(0), -1, acc, filled
        acc |= np.uint64(raw[r]) << np.uint64(filled)
        r += 1
        filled += 8
    value = acc & ((np.uint64(1) << np.uint64(bits)) - np.uint64(1))
    return value, r, acc >> np.uint64(bits), filled - bits


@compiled
def _decode(words, raw, raw_bits, freq, cum, lut, count, out):  # pragma: no cover - compiled
    """Integers from rANS `words` and `raw` bits; returns a status (`_OK` when consistent)."""
    if words.size < 2:
        return _TRUNCATED
    x = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(16))
    w = 2
    acc = np.uint64(0)
    filled = 0
    r = 0
    mask = np.uint64(_M - 1)
    for i in range(count):
        slot = x & mask
        s = lut[slot]
        x = np.uint64(freq[s]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(cum[s])
        if x < _L:
            if w == words.size:
                return _TRUNCATED
            x = (x << np.uint64(16)) | np.uint64(words[w])
            w += 1
        low, r, acc, filled = _take(raw, r, acc, filled, raw_bits)
        if r < 0:
            return _TRUNCATED
        if s < DIRECT:
            high = np.uint64(s)
        else:
            high_bits = s - DIRECT + 5  # the bit length less its top bit
            if raw_bits + high_bits + 1 > _MAX_BITS:
                return _OVERFLOW
            bits, r, acc, filled = _take(raw, r, acc, filled, high_bits)
            if r < 0:
                return _TRUNCATED
            high = (np.uint64(1) << np.uint64(high_bits)) | bits
        out[i] = np.int64((high << np.uint64(raw_bits)) | low)
    if x != _L or w != words.size or r != raw.size or acc != 0:
        return _TRAILING
    return _OK


def _leb128(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _read_leb128(data: memoryview, p: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if p >= len(data) or shift > 63:
            raise FormatError(f"{what}: truncated or overlong varint")
        byte = data[p]
        p += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, p
        shift += 7


def _quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to 2**PROB_BITS, every present symbol at least 1 (deterministic)."""
    total = int(counts.sum())
    freq = np.where(counts > 0, np.maximum(1, counts * _M // total), 0).astype(np.int64)
    excess = int(freq.sum()) - _M
    order = np.argsort(-freq, kind="stable")
    i = 0
    while excess != 0:  # move the rounding error onto the most frequent symbols
        s = order[i % order.size]
        if excess > 0 and freq[s] > 1:
            step = min(excess, int(freq[s]) - 1)
            freq[s] -= step
            excess -= step
        elif excess < 0:
            freq[s] -= excess
            excess = 0
        i += 1
    return freq


def encode_integers(values: np.ndarray, raw_bits: int) -> bytes:
    """One stream holding `values` (non-negative int64, each below 2**57, `raw_bits` <= 40)."""
    values = np.ascontiguousarray(values, np.int64)
    if not 0 <= raw_bits <= 40:
        raise ValueError(f"raw_bits must lie in 0..40, got {raw_bits}")
    if values.size and (int(values.min()) < 0 or int(values.max()) >> _MAX_BITS):
        raise ValueError(f"integers must lie in [0, 2**{_MAX_BITS})")
    symbols = np.empty(values.size, np.int32)
    counts = np.zeros(ALPHABET, np.int64)
    extra = _symbols(values, raw_bits, symbols, counts)
    freq = _quantize(counts) if values.size else np.zeros(0, np.int64)
    table = freq[: int(np.flatnonzero(freq)[-1]) + 1] if values.size else freq
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]) if freq.size else freq
    raw = np.empty((values.size * raw_bits + extra + 7) // 8, np.uint8)
    raw_len = _write_raw(values, raw_bits, symbols, raw)
    words = np.empty(values.size + 2, np.uint16)
    first = _rans_encode(symbols, freq, cum, words) if values.size else words.size
    head = bytes([raw_bits]) + _leb128([table.size, *table.tolist(), raw_len])
    return head + raw[:raw_len].tobytes() + words[first:].tobytes()


def decode_integers(data: bytes | np.ndarray, count: int, what: str) -> np.ndarray:
    """The `count` integers of a stream `encode_integers` wrote (`FormatError` otherwise)."""
    view = memoryview(np.ascontiguousarray(np.frombuffer(data, np.uint8)))
    if count == 0:
        if len(view) > 3:
            raise FormatError(f"{what}: {len(view)} bytes for no integers")
        return np.zeros(0, np.int64)
    if not view:
        raise FormatError(f"{what}: empty stream")
    raw_bits = view[0]
    if raw_bits > 40:
        raise FormatError(f"{what}: {raw_bits} raw bits per integer, at most 40")
    size, p = _read_leb128(view, 1, what)
    if not 1 <= size <= ALPHABET:
        raise FormatError(f"{what}: table of {size} symbols, expected 1..{ALPHABET}")
    freq = np.zeros(ALPHABET, np.int64)
    for s in range(size):
        freq[s], p = _read_leb128(view, p, what)
    if int(freq.sum()) != _M:
        raise FormatError(f"{what}: frequencies sum to {int(freq.sum())}, not {_M}")
    raw_len, p = _read_leb128(view, p, what)
    if raw_len > len(view) - p or count * (raw_bits + _MAX_BITS) < 8 * (raw_len - 1):
        raise FormatError(f"{what}: raw section of {raw_len} bytes does not fit")
    raw = np.frombuffer(view, np.uint8, raw_len, p)
    rest = len(view) - p - raw_len
    if rest % 2 or rest // 2 > count + 2:
        raise FormatError(f"{what}: rANS section of {rest} bytes for {count} integers")
    words = (
        np.frombuffer(view, np.uint16, rest // 2, p + raw_len) if rest else np.zeros(0, np.uint16)
    )
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    lut = np.repeat(np.arange(ALPHABET, dtype=np.int32), freq)
    out = np.empty(count, np.int64)
    status = _decode(words, raw, raw_bits, freq, cum, lut, count, out)
    if status != _OK:
        problem = {
            _TRUNCATED: "ends early",
            _TRAILING: "does not end where its coder began (altered or trailing bytes)",
            _OVERFLOW: "holds an integer too large",
        }.get(status, "is malformed")
        raise FormatError(f"{what}: stream {problem}")
    return out
