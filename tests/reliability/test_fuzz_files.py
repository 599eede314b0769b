"""Fuzzing deltas (`ans`, `ctx`, `packed`, `coo`) and anchors made by the real library: hostile
files are refused with a `DeltaSyncError` and change nothing; a mutation that stays valid yields
exactly the state the file's digests promise (anchors: every tensor; deltas: the full-state
digest, and the whole state bitwise equal to the real next version)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from mutations import file_mutation
from wire_samples import Chain, bitwise_equal, build_chain, digests, fingerprint, replica_at

from deltasync.codec import decode, read_metadata
from deltasync.errors import DeltaSyncError
from deltasync.kernels.state_hash import full_state_digest
from deltasync.wire.header import parse_header_bytes
from deltasync.wire.metadata import FileMetadata

# Sized for ~2 minutes for the whole folder on 2 CPU cores (see RELIABILITY.md for counts).
FUZZ = settings(
    max_examples=1500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHAIN: Chain = build_chain(4)
PATH = "runs/run/deltas/fuzzed.safetensors"


def _outcome(exc: DeltaSyncError) -> str:
    """A short label for hypothesis' statistics: the error type and its first plain words."""
    words = [w for w in str(exc).split() if w.isalpha()][:3]
    return f"{type(exc).__name__}: {' '.join(words)}"


def _event(label: str) -> None:
    """`hypothesis.event`, also callable from the plain tests that share the helpers."""
    with contextlib.suppress(InvalidArgument):
        event(label)


def _update(replica, blob: bytes) -> bool | None:
    """Stage then apply `blob`; None when refused (then the state must be unchanged)."""
    before = fingerprint(replica)
    try:
        staged = replica.stage([(blob, PATH)])
        assert fingerprint(replica) == before  # staging validates, it never mutates
        applied = bool(replica.commit(staged))
    except DeltaSyncError as exc:
        _event(_outcome(exc))
        assert fingerprint(replica) == before
        return None
    if not applied:
        _event("no-op (a version the replica holds)")
        assert fingerprint(replica) == before
    else:
        _event("accepted")
    return applied


def _accepted_meta(blob: bytes, replica) -> FileMetadata:
    """An applied file must parse, and the replica must now hold the run and version it names."""
    meta = FileMetadata.from_strings(parse_header_bytes(blob).metadata)
    assert (replica.run_id, replica.version) == (meta.run_id, meta.version)
    return meta


def _delta_fuzz(blob: bytes) -> None:
    replica = replica_at(CHAIN, 1)
    if _update(replica, blob):
        meta = _accepted_meta(blob, replica)
        assert meta.kind == "delta" and meta.version == 2
        # The replica verified the whole state the file promises (its per-tensor digests are a
        # record, not re-hashed on apply: bucket_layout.md), and nothing else moved.
        assert full_state_digest(replica.tensors) == meta.state_digest
        assert bitwise_equal(replica.tensors, CHAIN.states[2])


@FUZZ
@given(blob=file_mutation(CHAIN.deltas["packed", 2]))
def test_fuzz_packed_delta(blob: bytes) -> None:
    _delta_fuzz(blob)


@FUZZ
@given(blob=file_mutation(CHAIN.deltas["ans", 2]))
def test_fuzz_ans_delta(blob: bytes) -> None:
    _delta_fuzz(blob)


@FUZZ
@given(blob=file_mutation(CHAIN.deltas["ctx", 2]))
def test_fuzz_ctx_delta(blob: bytes) -> None:
    _delta_fuzz(blob)


@FUZZ
@given(blob=file_mutation(CHAIN.deltas["coo", 2]))
def test_fuzz_coo_delta(blob: bytes) -> None:
    _delta_fuzz(blob)


@settings(FUZZ, max_examples=1000)
@given(blob=file_mutation(CHAIN.anchors[3]), start=st.sampled_from([None, 1]))
def test_fuzz_anchor(blob: bytes, start: int | None) -> None:
    """An anchor of version 3 to an empty replica or one at version 1 of the same run."""
    replica = replica_at(CHAIN, start)
    if _update(replica, blob):
        meta = _accepted_meta(blob, replica)
        assert meta.kind == "anchor"
        # Anchors are verified in full: every tensor hashes to its declared digest.
        assert digests(replica.tensors) == {n: e.digest for n, e in meta.tensors.items()}
        assert bitwise_equal(replica.tensors, CHAIN.states[3])


SOURCES = {
    "ans": CHAIN.deltas["ans", 2],
    "ctx": CHAIN.deltas["ctx", 2],
    "packed": CHAIN.deltas["packed", 2],
    "coo": CHAIN.deltas["coo", 2],
    "anchor": CHAIN.anchors[3],
}


@settings(FUZZ, max_examples=1000)
@given(data=st.data(), source=st.sampled_from(sorted(SOURCES)))
def test_fuzz_codec_decode_and_read_metadata(data, source: str) -> None:
    """The codec's own entry points: `read_metadata` (header only, with and without the file
    size, as the dashboard calls it) and `decode`, which never mutates the base it is given."""
    blob = data.draw(file_mutation(SOURCES[source]))
    view = memoryview(blob)
    for size in (len(blob), None):
        try:
            read_metadata(lambda a, b: bytes(view[a:b]), size, path=PATH)
        except DeltaSyncError as exc:
            event(f"read_metadata {_outcome(exc)}")
    base = {n: t.clone() for n, t in CHAIN.states[1].items()}
    try:
        decoded = decode(blob, base=base, path=PATH)
    except DeltaSyncError as exc:
        event(f"decode {_outcome(exc)}")
    else:
        event(f"decode accepted {decoded.meta.kind}")
        for change in decoded.changes.values():  # indices in range and strictly ascending
            assert change.indices.dtype == torch.int64 and change.values.dtype == torch.bfloat16
            assert change.indices.numel() == change.values.numel()
            if change.indices.numel() > 1:
                assert bool((change.indices[1:] > change.indices[:-1]).all())
    assert bitwise_equal(base, CHAIN.states[1])


@pytest.mark.parametrize("encoding", ["ans", "ctx", "packed", "coo"])
def test_unmutated_files_are_accepted(encoding: str) -> None:
    """The fuzzers start from valid files: the harness itself must accept them."""
    replica = replica_at(CHAIN, 1)
    assert _update(replica, CHAIN.deltas[encoding, 2]) is True
    assert bitwise_equal(replica.tensors, CHAIN.states[2])
    assert _update(replica_at(CHAIN, 1), CHAIN.anchors[3]) is True
