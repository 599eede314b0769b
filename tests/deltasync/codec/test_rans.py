"""The rANS integer streams under the `ans` encoding: exact round trips, sizes at the empirical
entropy, and untrusted bytes refused with a `FormatError` (never a crash or an overrun)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec.ans import gap_raw_bits
from deltasync.codec.rans import (
    PROB_BITS,
    decode_gaps,
    decode_integers,
    encode_gaps,
    encode_integers,
)
from deltasync.errors import FormatError


def entropy_bits(values: np.ndarray) -> float:
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(counts * np.log2(p)).sum())


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    values=st.lists(st.integers(0, 2**57 - 1) | st.integers(0, 70), max_size=300),
    raw_bits=st.integers(0, 40),
)
def test_round_trip(values, raw_bits):
    array = np.array(values, np.int64)
    data = encode_integers(array, raw_bits)
    assert np.array_equal(decode_integers(data, array.size, "x"), array)


def test_geometric_gaps_cost_their_entropy():
    rng = np.random.default_rng(0)
    for density in (0.015, 0.03, 0.1):
        gaps = rng.geometric(density, 200_000) - 1
        indices = np.cumsum(gaps + 1) - 1
        data = encode_gaps(indices, gap_raw_bits(indices))
        assert 8 * len(data) <= 1.01 * entropy_bits(gaps), density
        assert np.array_equal(decode_gaps(data, indices.size, int(indices[-1]) + 1, "g"), indices)
        with pytest.raises(FormatError, match="past the tensor"):
            decode_gaps(data, indices.size, int(indices[-1]), "g")


def test_gaps_of_indices_that_do_not_ascend_are_refused():
    for indices in ([3, 3], [5, 2], [-1], [0, 2**57 + 1]):
        with pytest.raises(ValueError, match="ascending"):
            encode_gaps(np.array(indices, np.int64), 0)


def test_skewed_steps_cost_their_entropy():
    rng = np.random.default_rng(1)
    codes = rng.choice(6, 200_000, p=[0.42, 0.40, 0.07, 0.06, 0.03, 0.02])
    size = 8 * len(encode_integers(codes, 0))
    assert size <= 1.002 * entropy_bits(codes)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="raw_bits"):
        encode_integers(np.zeros(3, np.int64), 41)
    with pytest.raises(ValueError, match="2\\*\\*57"):
        encode_integers(np.array([2**57]), 0)
    with pytest.raises(ValueError):
        encode_integers(np.array([-1]), 0)


@pytest.fixture(scope="module")
def stream() -> tuple[bytes, np.ndarray]:
    values = np.random.default_rng(2).geometric(0.05, 5000) - 1
    return encode_integers(values, 3).tobytes(), values


def test_truncated_extended_or_miscounted_streams_are_refused(stream):
    data, values = stream
    for cut in (1, 2, 3, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(FormatError):
            decode_integers(data[:-cut], values.size, "gaps")
    for extra in (b"\0", b"\0\0", b"\xff\xff"):
        with pytest.raises(FormatError):
            decode_integers(data + extra, values.size, "gaps")
    for count in (values.size - 1, values.size + 1, 0):
        with pytest.raises(FormatError):
            decode_integers(data, count, "gaps")


def test_bad_headers_and_tables_are_refused(stream):
    data, values = stream
    for header in (
        bytes([41]) + data[1:],  # more raw bits than an integer may have
        bytes([3, 0]) + data[2:],  # an empty table
        bytes([3, 100]) + data[2:],  # more symbols than the alphabet
        bytes([3, 1]),  # a table cut short
    ):
        with pytest.raises(FormatError, match="malformed header"):
            decode_integers(header, values.size, "gaps")
    assert PROB_BITS == 14
    with pytest.raises(FormatError, match="sum to 2"):
        decode_integers(bytes([0, 1, 5, 0]), 3, "gaps")
    one_symbol = bytes([0, 1, 0x80, 0x80, 0x01])  # frequency 2**14 sums right, nothing follows
    with pytest.raises(FormatError):
        decode_integers(one_symbol, 3, "gaps")


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_random_edits_are_refused_or_decode_to_count_integers(stream, data):
    """A flipped, inserted or deleted byte: `FormatError`, or `count` in-range integers (raw
    bits carry no redundancy: the file and state digests catch those)."""
    blob, values = stream
    edited = bytearray(blob)
    at = data.draw(st.integers(0, len(edited) - 1))
    action = data.draw(st.sampled_from(["flip", "insert", "delete", "garbage"]))
    if action == "flip":
        edited[at] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "insert":
        edited.insert(at, data.draw(st.integers(0, 255)))
    elif action == "delete":
        del edited[at]
    else:
        edited = bytearray(data.draw(st.binary(max_size=200)))
    try:
        out = decode_integers(bytes(edited), values.size, "gaps")
    except FormatError:
        return
    assert out.size == values.size and int(out.min()) >= 0 and int(out.max()) < 2**57


def change_numel(model) -> int:
    return model.get_input_embeddings().weight.numel()


def test_a_nearly_dense_tensor_round_trips():
    """Real gaps of a tensor where nearly every element changed (99 % zeros): the dominant
    symbol keeps the coder's state high, where an inexact reciprocal division once went wrong."""
    from model_steps import AdamWLoop

    from bench.models.qwen3 import tiny_qwen3
    from deltasync.codec.ans import _codes
    from deltasync.publisher.snapshot import Bf16Snapshot

    model = tiny_qwen3()
    snapshot = Bf16Snapshot.capture(model)
    loop = AdamWLoop(model, lr=1e-3)
    for _ in range(3):
        loop.step()
    change = snapshot.diff(model).changes["model.embed_tokens.weight"]
    indices = change.indices.numpy()
    assert indices.size > 0.98 * change_numel(model)
    data = encode_gaps(indices, 0)
    assert np.array_equal(decode_gaps(data, indices.size, int(indices[-1]) + 1, "g"), indices)
    codes = _codes(change)
    assert np.array_equal(decode_integers(encode_integers(codes, 0), codes.size, "v"), codes)
