"""The full-state digest `cubesum-4x31`: its definition, the partitions it composes over (FSDP2
row shards, vLLM tensor-parallel boxes), O(changed) updates, single-element detection, and the
compiled CPU kernels against the tensor ops every device runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.errors import FormatError
from deltasync.kernels.changes import TensorChange
from deltasync.kernels.state_hash import (
    apply_changes,
    change_sum,
    device_sum,
    indexed_sum,
    state_sums,
    tensor_sum,
)
from deltasync.wire.digests import PRIMES, StateDigest, tensor_keys, total

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = [0x0000, 0x8000, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80, 0x0001]  # zeros, max, inf, tiny


def reference(name: str, indices, bits) -> StateDigest:
    """The definition in bucket_layout.md, in Python integers."""
    lanes = []
    for keys, p in zip(tensor_keys(name), PRIMES, strict=True):
        a, a_hi, g, b = keys
        s = 0
        for i, w in zip(indices, bits, strict=True):
            x = (a * (i % 2**31) + a_hi * (i // 2**31) + g + b * ((w & 0xFFFF) + 1)) % p
            s += pow(x, 3, p)
        lanes.append(s % p)
    return StateDigest(tuple(lanes))


def bf16(bits) -> torch.Tensor:
    return torch.tensor(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def random_bf16(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits.reshape(-1)[: len(SPECIAL)] = SPECIAL[: bits.size]
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def test_matches_the_definition_across_the_2_pow_31_index_boundary():
    rng = np.random.default_rng(0)
    t = random_bf16(rng, 3000)
    bits = t.view(torch.int16).tolist()
    for start in (0, 2**31 - 1000, 2**45 + 7):
        expected = reference("w", range(start, start + 3000), bits)
        assert tensor_sum("w", t, start=start) == expected
        assert device_sum("w", t, start=start) == expected
    idx = torch.from_numpy(np.sort(rng.choice(2**50, 3000, replace=False)))
    expected = reference("w", idx.tolist(), bits)
    assert indexed_sum("w", idx, t) == expected
    assert device_sum("w", t, index=idx) == expected
    previous = random_bf16(rng, 3000)
    moved = expected - reference("w", idx.tolist(), previous.view(torch.int16).tolist())
    assert change_sum("w", TensorChange(idx, t, previous)) == moved


def test_empty_tensor_is_zero_and_names_are_keys():
    assert tensor_sum("w", torch.zeros(0, dtype=torch.bfloat16)) == StateDigest.zero()
    t = random_bf16(np.random.default_rng(1), 64)
    assert tensor_sum("a.weight", t) != tensor_sum("b.weight", t)  # same bytes, other tensor


@SETTINGS
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 24),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_row_partition_sums_to_the_whole(rows, cols, cuts, seed):
    t = random_bf16(np.random.default_rng(seed), rows, cols)
    bounds = sorted({0, rows, *(c for c in cuts if c <= rows)})
    parts = [tensor_sum("m.weight", t[a:b], start=a * cols) for a, b in itertools.pairwise(bounds)]
    assert total(parts) == tensor_sum("m.weight", t)


@SETTINGS
@given(
    rows=st.integers(1, 30),
    cols=st.integers(1, 30),
    cuts=st.lists(st.integers(0, 30), max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_column_slices_sum_to_the_whole(rows, cols, cuts, seed):
    t = random_bf16(np.random.default_rng(seed), rows, cols)
    index = torch.arange(rows * cols).view(rows, cols)
    bounds = sorted({0, cols, *(c for c in cuts if c <= cols)})
    on_device, compiled = [], []
    for a, b in itertools.pairwise(bounds):
        piece = t[:, a:b]  # a strided view, as a row-parallel rank holds it
        on_device.append(device_sum("m.weight", piece, index=index[:, a:b]))
        compiled.append(indexed_sum("m.weight", index[:, a:b], piece.contiguous()))
    whole = tensor_sum("m.weight", t)
    assert total(on_device) == whole and total(compiled) == whole


@SETTINGS
@given(rows=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_fsdp2_dim0_shards_sum_to_the_whole(rows, world, seed):
    """FSDP2's `Shard(0)`: `torch.chunk` along dim 0, uneven (17 rows on 2 ranks: 9 + 8),
    trailing ranks possibly empty; each rank hashes its local rows at their global offset."""
    t = random_bf16(np.random.default_rng(seed), rows, 6)
    shards, offset = [], 0
    for local in torch.chunk(t, world, dim=0):
        shards.append(tensor_sum("w", local, start=offset * 6))
        offset += local.shape[0]
    shards += [StateDigest.zero()] * (world - len(shards))  # ranks with no rows
    assert total(shards) == tensor_sum("w", t)


@SETTINGS
@given(heads=st.integers(1, 4), kv=st.integers(1, 2), seed=st.integers(0, 2**32 - 1))
def test_vllm_tp2_fused_qkv_and_row_parallel_slices(heads, kv, seed):
    """vLLM TP 2: rank r's `qkv_proj` stacks its halves of q, k and v (column-parallel); its
    `o_proj` holds half the columns (row-parallel). Each HF tensor's digest is the sum of the
    ranks' pieces, hashed where they lie."""
    rng = np.random.default_rng(seed)
    hidden, dim = 8, 4
    hf = {
        "q_proj.weight": random_bf16(rng, 2 * heads * dim, hidden),
        "k_proj.weight": random_bf16(rng, 2 * kv * dim, hidden),
        "v_proj.weight": random_bf16(rng, 2 * kv * dim, hidden),
        "o_proj.weight": random_bf16(rng, hidden, 2 * heads * dim),
    }
    parts: dict[str, list[StateDigest]] = {name: [] for name in hf}
    for rank in range(2):
        fused = torch.cat([torch.chunk(hf[n], 2)[rank] for n in list(hf)[:3]])  # rank's qkv_proj
        row = 0
        for name in list(hf)[:3]:
            rows = hf[name].shape[0] // 2
            piece = fused[row : row + rows]
            parts[name].append(device_sum(name, piece, start=rank * rows * hidden))
            row += rows
        cols = hf["o_proj.weight"].shape[1] // 2
        index = torch.arange(hf["o_proj.weight"].numel()).view(hidden, -1)
        local = torch.chunk(hf["o_proj.weight"], 2, dim=1)[rank]
        parts["o_proj.weight"].append(
            device_sum("o_proj.weight", local, index=index[:, rank * cols : (rank + 1) * cols])
        )
    assert {n: total(p) for n, p in parts.items()} == state_sums(hf)


@SETTINGS
@given(vocab=st.integers(1, 300), tp=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1))
def test_vocab_parallel_shards_with_padding(vocab, tp, seed):
    """vLLM pads the vocabulary to a multiple of 64 x tp and gives each rank a contiguous block of
    padded rows; padding rows are not part of the HF tensor and are left out."""
    hidden = 3
    t = random_bf16(np.random.default_rng(seed), vocab, hidden)
    padded = -(-vocab // (64 * tp)) * 64 * tp
    weight = torch.cat([t, random_bf16(np.random.default_rng(seed + 1), padded - vocab, hidden)])
    per_rank = padded // tp
    parts = []
    for rank in range(tp):
        first = rank * per_rank
        real = max(0, min(per_rank, vocab - first))  # rows of this rank that are real tokens
        local = weight[first : first + per_rank]
        parts.append(tensor_sum("embed", local[:real], start=first * hidden))
    assert total(parts) == tensor_sum("embed", t)


@SETTINGS
@given(
    numel=st.integers(1, 500),
    changes=st.integers(0, 60),
    seed=st.integers(0, 2**32 - 1),
)
def test_update_from_changed_elements_equals_a_full_recompute(numel, changes, seed):
    rng = np.random.default_rng(seed)
    old = {"a": random_bf16(rng, numel), "b": random_bf16(rng, 7)}
    new = {n: t.clone() for n, t in old.items()}
    index = torch.from_numpy(np.sort(rng.choice(numel, min(changes, numel), replace=False)))
    new["a"][index] = random_bf16(rng, index.numel())
    keep = new["a"][index].view(torch.int16) != old["a"][index].view(torch.int16)
    index = index[keep]
    change = TensorChange(index, new["a"][index], old["a"][index])
    assert apply_changes(state_sums(old), {"a": change}) == state_sums(new)


@SETTINGS
@given(
    numel=st.integers(1, 2000),
    where=st.integers(0, 1999),
    bits=st.one_of(st.sampled_from(SPECIAL), st.integers(0, 0xFFFF)),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_single_element_change_moves_every_lane(numel, where, bits, seed):
    t = random_bf16(np.random.default_rng(seed), numel)
    flipped = t.clone()
    flipped.view(torch.int16)[where % numel] = int(np.uint16(bits).view(np.int16))
    if torch.equal(flipped.view(torch.int16), t.view(torch.int16)):
        return
    before, after = tensor_sum("w", t), tensor_sum("w", flipped)
    assert all(x != y for x, y in zip(before.lanes, after.lanes, strict=True))


@SETTINGS
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    start=st.integers(0, 2**50),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_kernels_and_tensor_ops_are_bit_identical(shape, start, seed):
    t = random_bf16(np.random.default_rng(seed), *shape)
    assert tensor_sum("x", t, start=start) == device_sum("x", t, start=start)


def test_large_tensor_splits_over_threads_without_changing_the_sum():
    t = random_bf16(np.random.default_rng(2), (1 << 24) + 12345)  # more than one task
    assert state_sums({"big": t})["big"] == tensor_sum("big", t)
    assert total(state_sums({"big": t})) == device_sum("big", t)


def test_text_form_round_trips_and_refuses_malformed_values():
    digest = tensor_sum("w", random_bf16(np.random.default_rng(3), 10))
    assert StateDigest.parse(digest.hex()) == digest and len(digest.hex()) == 32
    for bad in (digest.hex().upper(), digest.hex()[:-1], None, 5, "f" * 32):
        with pytest.raises(FormatError):
            StateDigest.parse(bad)


def test_digests_add_and_subtract_per_lane():
    a = StateDigest((PRIMES[0] - 1, 0, 5, 7))
    b = StateDigest((2, 3, PRIMES[2] - 1, 0))
    assert (a + b).lanes == (1, 3, 4, 7)
    assert (a + b) - b == a
