"""The compiled LEB128 encoders match a byte-at-a-time reference; the compiled decoders
round-trip them and refuse bad streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec.varint import (
    gap_varints,
    indices_from_gaps,
    step_varints,
    values_from_steps,
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


def reference_zigzag16(new: int, old: int) -> int:
    step = (new - old + 2**15) % 2**16 - 2**15  # int16 wrap-around
    return 2 * step if step >= 0 else -2 * step - 1


@settings(deadline=None)  # the first call in a process loads the compiled kernels
@given(st.sets(st.integers(0, 2**50), max_size=200))
def test_gaps_match_reference_and_round_trip(index_set):
    indices = sorted(index_set)
    gaps = [b - a - 1 for a, b in zip([-1, *indices][:-1], indices, strict=True)]
    encoded = gap_varints(np.array(indices, np.int64))
    assert encoded.tobytes() == reference_leb128(gaps)
    decoded = indices_from_gaps(encoded, len(indices), numel=2**50 + 1)
    assert decoded.dtype == np.int64
    assert decoded.tolist() == indices


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
    # the base holds the old bits at every other position of a larger tensor
    base = np.full(2 * len(pairs) + 1, 7, np.int16)
    indices = np.arange(len(pairs), dtype=np.int64) * 2 + 1
    base[indices] = old
    previous, values = values_from_steps(encoded, base, indices)
    assert np.array_equal(previous, old)
    assert np.array_equal(values, new)


def test_small_steps_take_one_byte():
    old = np.zeros(4, np.int16)
    assert step_varints(np.array([0, -1, 1, 63], np.int16), old).tobytes() == bytes([0, 1, 2, 126])
    assert len(step_varints(np.array([64], np.int16), old[:1])) == 2


@pytest.mark.parametrize(
    ("stream", "count", "message"),
    [
        (b"\x01\x02", 3, "holds 2 integers, expected 3"),
        (b"\x01\x02\x03", 2, "holds 3 integers, expected 2"),
        (b"\x01\x82", 1, "holds 1 integers"),  # unterminated last integer
        (b"\x80" * 10 + b"\x00", 1, "longer than 10 bytes"),  # overlong zero
        (b"\xff" * 9 + b"\x01", 1, "out of range"),  # 2**63 and more
        (b"\x80\x01", 1, "out of range"),  # gap 128 in a tensor of 100
        (b"\x00" * 50 + b"\x32", 51, "run past the tensor.s 100 elements"),  # index 100
    ],
    ids=["too-few", "too-many", "unterminated", "overlong", "huge", "gap-too-big", "run-past"],
)
def test_bad_gap_streams_are_refused(stream, count, message):
    with pytest.raises(FormatError, match=message):
        indices_from_gaps(np.frombuffer(stream, np.uint8), count, numel=100)


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (b"\x80\x80\x04\x00", "out of range"),  # 2**16: no int16 step zigzags to it
        (b"\x01", "holds 1 integers, expected 2"),
        (b"\x01\x01\x01", "holds 3 integers, expected 2"),
    ],
    ids=["step-too-big", "too-few", "too-many"],
)
def test_bad_step_streams_are_refused(stream, message):
    with pytest.raises(FormatError, match=message):
        values_from_steps(
            np.frombuffer(stream, np.uint8), np.zeros(4, np.int16), np.array([0, 3], np.int64)
        )


def test_last_index_may_be_the_last_element():
    assert indices_from_gaps(np.array([0, 98], np.uint8), 2, numel=100).tolist() == [0, 99]
