"""The compiled LEB128 encoders match a byte-at-a-time reference; the decoder round-trips them
and refuses bad streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec.varint import gap_varints, leb128_decode, step_varints, zigzag_decode16
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


def reference_zigzag16(new: int, old: int) -> int:
    step = (new - old + 2**15) % 2**16 - 2**15  # int16 wrap-around
    return 2 * step if step >= 0 else -2 * step - 1


@settings(deadline=None)  # the first call in a process loads the compiled kernels
@given(st.sets(st.integers(0, 2**62), max_size=200))
def test_gaps_match_reference_and_round_trip(index_set):
    indices = sorted(index_set)
    gaps = [b - a - 1 for a, b in zip([-1, *indices][:-1], indices, strict=True)]
    encoded = gap_varints(np.array(indices, np.int64))
    assert encoded.tobytes() == reference_leb128(gaps)
    decoded = leb128_decode(encoded, len(gaps), limit=2**63)
    assert np.array_equal(np.cumsum(decoded.astype(np.int64) + 1) - 1, np.array(indices, np.int64))


@settings(deadline=None)  # the first call in a process loads the compiled kernels
@given(
    st.lists(
        st.tuples(st.integers(-(2**15), 2**15 - 1), st.integers(-(2**15), 2**15 - 1)), max_size=200
    )
)
def test_steps_match_reference_and_round_trip(pairs):
    new = np.array([n for n, _ in pairs], np.int16)
    old = np.array([o for _, o in pairs], np.int16)
    codes = [reference_zigzag16(n, o) for n, o in pairs]
    encoded = step_varints(new, old)
    assert encoded.tobytes() == reference_leb128(codes)
    steps = zigzag_decode16(leb128_decode(encoded, len(pairs), limit=2**16))
    assert np.array_equal(old + steps, new)  # int16 arithmetic wraps as the encoder's did


def test_small_steps_take_one_byte():
    old = np.zeros(4, np.int16)
    assert step_varints(np.array([0, -1, 1, 63], np.int16), old).tobytes() == bytes([0, 1, 2, 126])
    assert len(step_varints(np.array([64], np.int16), old[:1])) == 2


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
