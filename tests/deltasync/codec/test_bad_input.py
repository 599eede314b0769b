"""Corrupt, truncated, oversized, out-of-range, mistyped, misnamed files: clear error, no change."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from deltasync.codec import encode_anchor, encode_delta
from deltasync.errors import ChainError, DeltaSyncError, DigestMismatch, FormatError
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.wire.digests import total
from deltasync.wire.header import MAX_HEADER_BYTES


def _base():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(32, 16).bfloat16(), "b.bias": torch.randn(40).bfloat16()}


@pytest.fixture
def setup():
    base = _base()
    new = {k: v.clone() for k, v in base.items()}
    new["a.weight"].view(-1)[[0, 7, 300, 511]] += 1
    new["b.bias"][39] = -new["b.bias"][39]
    replica = Replica()
    replica.update(encode_anchor(base, run_id="run", version=1))
    diff = Bf16Snapshot({k: v.clone() for k, v in base.items()}).diff(new)
    return replica, diff


def _delta(diff, encoding="packed", base=None, **kw):
    """A delta from `base` (the fixture's), with the full-state digest the state after it has."""
    base = base or _base()
    digest = total(apply_changes(state_sums(base), diff.changes))
    args = {"run_id": "run", "version": 2, "base_version": 1, "state_digest": digest} | kw
    return encode_delta(diff, encoding=encoding, base=base, **args)


def _state(replica):
    return replica.run_id, replica.version, replica.digests()


def _rewrite(blob: bytes, mutate) -> bytes:
    """Re-save a file with its tensors or metadata changed by `mutate(tensors, metadata)`."""
    tensors = safetensors.torch.load(blob)
    (n,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8 : 8 + n])["__metadata__"]
    mutate(tensors, metadata)
    return safetensors.torch.save(tensors, metadata=metadata)


def _refused(replica, blob, error=DeltaSyncError):
    before = _state(replica)
    with pytest.raises(error) as info:
        replica.update(blob, path="deltas/x.safetensors")
    assert _state(replica) == before
    return str(info.value)


@pytest.mark.parametrize("encoding", ["ctx", "ans", "packed", "coo"])
def test_truncated_file(setup, encoding):
    replica, diff = setup
    blob = _delta(diff, encoding)
    for cut in (0, 5, 8, 20, len(blob) // 2, len(blob) - 1):
        _refused(replica, blob[:cut], FormatError)


def test_oversized_header_is_refused_before_reading_it(setup):
    replica, _ = setup
    blob = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"
    assert "header size" in _refused(replica, blob, FormatError)


def test_header_not_json(setup):
    replica, _ = setup
    _refused(replica, struct.pack("<Q", 4) + b"\xff{x}", FormatError)


@pytest.mark.parametrize("encoding", ["ctx", "ans", "packed", "coo"])
def test_corrupt_payload_bytes_never_apply(setup, encoding):
    replica, diff = setup
    blob = _delta(diff, encoding)
    (n,) = struct.unpack("<Q", blob[:8])
    rng = np.random.default_rng(1)
    anchor = encode_anchor(replica.tensors, run_id="run", version=1)
    for position in rng.integers(8 + n, len(blob), 40):
        corrupt = bytearray(blob)
        corrupt[position] ^= 0x5A
        before = _state(replica)
        try:
            replica.update(bytes(corrupt))
        except (FormatError, DigestMismatch):
            assert _state(replica) == before
        else:  # a flip that leaves the file valid must have produced the promised bytes
            assert replica.version == 2
            replica = Replica()
            replica.update(anchor)


def test_out_of_range_index_coo(setup):
    replica, diff = setup

    def mutate(tensors, _):
        tensors["b.bias.indices"] = torch.tensor([40], dtype=torch.int32)

    assert "out of range" in _refused(replica, _rewrite(_delta(diff, "coo"), mutate), FormatError)


def test_unsorted_indices_coo(setup):
    replica, diff = setup

    def mutate(tensors, _):
        tensors["a.weight.indices"] = tensors["a.weight.indices"].flip(0).contiguous()

    assert "ascending" in _refused(replica, _rewrite(_delta(diff, "coo"), mutate), FormatError)


def test_wrong_dtype(setup):
    replica, diff = setup

    def mutate(tensors, _):
        tensors["a.weight.values"] = tensors["a.weight.values"].float()

    assert "BF16" in _refused(replica, _rewrite(_delta(diff, "coo"), mutate), FormatError)


@pytest.mark.parametrize("encoding", ["ctx", "ans", "packed", "coo"])
def test_unknown_tensor_name(setup, encoding):
    replica, _ = setup
    other = {"a.weight": replica.tensors["a.weight"], "c.weight": torch.zeros(4).bfloat16()}
    changed = {k: v.clone() for k, v in other.items()}
    changed["c.weight"][0] = 1
    diff = Bf16Snapshot({k: v.clone() for k, v in other.items()}).diff(changed)
    assert "c.weight" in _refused(replica, _delta(diff, encoding, base=other), FormatError)


def test_packed_count_disagrees_with_metadata(setup):
    replica, diff = setup

    def mutate(_, metadata):
        entries = json.loads(metadata["tensors"])
        entries["a.weight"][2] += 1
        metadata["tensors"] = json.dumps(entries)

    _refused(replica, _rewrite(_delta(diff), mutate), FormatError)


def test_zstd_bomb_is_refused(setup):
    replica, diff = setup
    import zstandard

    def mutate(tensors, _):
        bomb = zstandard.ZstdCompressor().compress(b"\x01" * 10_000_000)
        tensors["a.weight.gaps"] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)

    assert "at most" in _refused(replica, _rewrite(_delta(diff), mutate), FormatError)


def test_state_digest_mismatch_rolls_back(setup):
    replica, diff = setup

    def mutate(_, metadata):
        metadata["state_digest"] = "0" * 32

    _refused(replica, _rewrite(_delta(diff), mutate), DigestMismatch)


def test_anchor_tensor_digest_mismatch_names_the_tensor():
    anchor = encode_anchor(_base(), run_id="run", version=1)

    def mutate(_, metadata):
        entries = json.loads(metadata["tensors"])
        entries["b.bias"][1] = "0" * 32
        metadata["tensors"] = json.dumps(entries)

    with pytest.raises(DigestMismatch, match=r"b\.bias"):
        Replica().update(_rewrite(anchor, mutate))


def test_wrong_base_version_and_other_run(setup):
    replica, diff = setup
    assert "base 2" in _refused(replica, _delta(diff, version=3, base_version=2), ChainError)
    assert "run 'other'" in _refused(replica, _delta(diff, run_id="other"), ChainError)


def test_duplicate_version_is_a_noop(setup):
    replica, diff = setup
    blob = _delta(diff)
    assert replica.update(blob) is True
    digests = replica.digests()
    assert replica.update(blob) is False
    assert replica.digests() == digests


def test_unsupported_protocol(setup):
    replica, diff = setup

    def mutate(_, metadata):
        metadata["protocol"] = "deltasync/99"

    assert "deltasync/99" in _refused(replica, _rewrite(_delta(diff), mutate), FormatError)


def test_anchor_for_another_model_is_refused(setup):
    replica, _ = setup
    other = {"a.weight": torch.zeros(3, 3).bfloat16()}
    assert "another model" in _refused(replica, encode_anchor(other, run_id="run", version=5))


def test_legacy_file_needs_opt_in(setup):
    replica, diff = setup

    def mutate(_, metadata):
        for key in ("protocol", "run_id", "kind", "encoding", "tensors", "base_version"):
            metadata.pop(key)

    blob = _rewrite(_delta(diff, "coo"), mutate)
    assert "allow_legacy" in _refused(replica, blob, FormatError)
