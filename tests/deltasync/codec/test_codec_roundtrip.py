"""Every delta encoding round-trips bitwise for arbitrary shapes, change sets and bit patterns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.codec import decode, encode_anchor, encode_delta
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica

SPECIAL_BITS = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0x7F81,
    0xFFFF,
    0x0001,
    0x8001,
    0x007F,
    0x3F80,
    0xBF80,
]


def _bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


@st.composite
def change_sets(draw):
    """A base and a new state of 1-3 tensors whose bit patterns differ at chosen places."""
    tensors_old, tensors_new = {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        n = int(np.prod(shape))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        old = rng.integers(0, 2**16, n, dtype=np.uint16)
        mode = draw(st.sampled_from(["empty", "full", "edges", "random", "special"]))
        new = old.copy()
        if mode == "full":
            new = old + rng.integers(1, 2**16, n, dtype=np.uint16)
        elif mode == "edges":
            new[0] ^= 1
            new[-1] ^= 0x8000
        elif mode == "random":
            mask = rng.random(n) < draw(st.floats(0.0, 1.0))
            new[mask] += rng.integers(1, 2**16, int(mask.sum()), dtype=np.uint16)
        elif mode == "special":
            idx = rng.integers(0, n, min(n, 8))
            new[idx] = rng.choice(SPECIAL_BITS, idx.size)
            old[idx[: idx.size // 2]] = rng.choice(SPECIAL_BITS, idx.size // 2)
        tensors_old[f"t{i}.weight"] = _bits_to_bf16(old).reshape(shape)
        tensors_new[f"t{i}.weight"] = _bits_to_bf16(new).reshape(shape)
    return tensors_old, tensors_new


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


@pytest.mark.parametrize("encoding", ["ans", "ctx", "packed", "coo"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=change_sets())
def test_delta_round_trips_bitwise(encoding, data):
    old, new = data
    snapshot = Bf16Snapshot({k: v.clone() for k, v in old.items()})
    diff = snapshot.diff(new)
    blob = _delta(diff, old, new, encoding)
    decoded = decode(blob, base=old)
    for name in old:
        expected = np.flatnonzero(_bits(old[name]).ravel() != _bits(new[name]).ravel())
        change = decoded.changes.get(name)
        got = np.empty(0, np.int64) if change is None else change.indices.numpy()
        assert np.array_equal(got, expected)
        if change is not None:
            assert np.array_equal(_bits(change.values), _bits(new[name]).ravel()[expected])
    replica = Replica()
    replica.update(encode_anchor(old, run_id="run", version=1))
    replica.update(blob)
    for name in old:
        assert np.array_equal(_bits(replica.tensors[name]), _bits(new[name]))


def _delta(diff, old, new, encoding: str) -> bytes:
    """Version 2 of run `run` from `old` (what `ctx` codes against; the others ignore it)."""
    return encode_delta(
        diff,
        run_id="run",
        version=2,
        base_version=1,
        state_digest=full_state_digest(new),
        encoding=encoding,
        base=old,
    )


def test_diff_sees_signed_zero_nan_payload_and_subnormal_flips():
    old = _bits_to_bf16(np.array([0x0000, 0x7FC0, 0x0001, 0x3F80], np.uint16))
    new = _bits_to_bf16(np.array([0x8000, 0x7FC1, 0x0002, 0x3F80], np.uint16))
    diff = Bf16Snapshot({"w": old}).diff({"w": new})
    assert diff.changes["w"].indices.tolist() == [0, 1, 2]


def test_zero_change_delta_is_valid_and_empty():
    t = {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    diff = Bf16Snapshot(t).diff(t)
    for encoding in ("ctx", "ans", "packed", "coo"):
        decoded = decode(_delta(diff, t, t, encoding), base=t)
        assert decoded.changes == {}
        assert decoded.meta.sparsity == 1.0


def test_fp32_source_is_rounded_to_nearest_even_bf16():
    master = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(2**-130)], dtype=torch.float32)
    snapshot = Bf16Snapshot.capture({"w": master})
    assert torch.equal(snapshot.tensors["w"], master.to(torch.bfloat16))


def test_pending_diffs_chain_versions_without_moving_the_snapshot():
    base = {"w": torch.arange(64, dtype=torch.bfloat16)}
    v2 = {"w": base["w"].clone()}
    v2["w"][3] = 100
    v3 = {"w": v2["w"].clone()}
    v3["w"][3] = base["w"][3]  # reverted: differs from v2, equals the committed base
    v3["w"][5] = -7
    snapshot = Bf16Snapshot({"w": base["w"].clone()})
    d2 = snapshot.diff(v2)
    d3 = snapshot.diff(v3, pending=[d2])
    assert d3.changes["w"].indices.tolist() == [3, 5]
    assert torch.equal(d3.changes["w"].previous, torch.tensor([100, 5], dtype=torch.bfloat16))
    assert torch.equal(snapshot.tensors["w"], base["w"])
