"""The compiled change scan finds exactly the elements numpy's comparison finds, with their bits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.kernels.bitscan import changed_elements


def _expected(base: np.ndarray, new: np.ndarray):
    where = np.flatnonzero(base != new)
    return where, new[where], base[where]


def _check(base: np.ndarray, new: np.ndarray) -> None:
    got = changed_elements(base, new)
    for got_part, expected_part in zip(got, _expected(base, new), strict=True):
        assert got_part.dtype == expected_part.dtype
        assert np.array_equal(got_part, expected_part)


@settings(deadline=None)  # the first call in a process loads the compiled kernels
@given(
    size=st.integers(0, 1000),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_numpy_on_any_length_and_density(size, density, seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(-(2**15), 2**15, size, dtype=np.int16)
    new = base.copy()
    mask = rng.random(size) < density
    new[mask] ^= rng.integers(1, 2**16, int(mask.sum()), dtype=np.uint16).view(np.int16)
    _check(base, new)


@pytest.mark.parametrize("density", [0.0, 0.07, 0.3, 0.6, 1.0])
def test_buffers_grow_past_the_first_guess(density):
    """A million elements changing more than 1 in 4 overflow the first output buffers."""
    rng = np.random.default_rng(0)
    base = rng.integers(-(2**15), 2**15, 1_000_003, dtype=np.int16)
    new = base.copy()
    mask = rng.random(base.size) < density
    new[mask] += 1
    _check(base, new)


@pytest.mark.parametrize("where", [0, 63, 64, 127, 128, 999_999])
def test_single_change_at_block_edges(where):
    base = np.zeros(1_000_000, np.int16)
    new = base.copy()
    new[where] = -1
    indices, values, previous = changed_elements(base, new)
    assert indices.tolist() == [where] and values.tolist() == [-1] and previous.tolist() == [0]


def test_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="int16 arrays of the same shape"):
        changed_elements(np.zeros(3, np.int16), np.zeros(4, np.int16))
    with pytest.raises(ValueError, match="int16 arrays of the same shape"):
        changed_elements(np.zeros(3, np.int32), np.zeros(3, np.int32))
