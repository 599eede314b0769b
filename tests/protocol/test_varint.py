"""The vectorised LEB128 layer matches a byte-at-a-time reference and refuses bad streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltasync.codec.varint import (
    leb128_decode,
    leb128_encode,
    zigzag_decode16,
    zigzag_encode16,
)
from deltasync.errors import FormatError


def reference_leb128(values: list[int]) -> bytes:
    out = bytearray()
    for x in values:
        while True:
            low, x = x & 0x7F, x >> 7
            out.append(low | (0x80 if x else 0))
            if not x:
                break
    return bytes(out)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_matches_reference_and_round_trips(values):
    array = np.array(values, dtype=np.uint64)
    encoded = leb128_encode(array)
    assert encoded.tobytes() == reference_leb128(values)
    assert np.array_equal(leb128_decode(encoded, len(values), limit=2**64), array)


@given(st.lists(st.integers(-(2**15), 2**15 - 1), max_size=200))
def test_zigzag_round_trips_and_keeps_small_magnitudes_small(diffs):
    array = np.array(diffs, dtype=np.int16)
    codes = zigzag_encode16(array)
    assert np.array_equal(zigzag_decode16(codes), array)
    assert all(
        int(c) == (2 * d if d >= 0 else -2 * d - 1) for c, d in zip(codes, diffs, strict=True)
    )


@pytest.mark.parametrize(
    ("stream", "count", "message"),
    [
        (b"\x01\x02", 3, "holds 2 integers"),
        (b"\x01\x82", 1, "holds 1 integers"),  # unterminated last integer
        (b"\xff" * 11 + b"\x01", 1, "longer than 10 bytes"),
        (b"\x80\x01", 1, "out of range"),  # 128 >= limit
    ],
    ids=["wrong-count", "unterminated", "overlong", "out-of-range"],
)
def test_bad_streams_are_refused(stream, count, message):
    with pytest.raises(FormatError, match=message):
        leb128_decode(np.frombuffer(stream, np.uint8), count, limit=128)
