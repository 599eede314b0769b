"""Update notifications that arrive twice, late, early or from another run: each is a no-op or
refused with a `DeltaSyncError`, never misapplied; replicas that missed versions catch up
through the chain, or through the next anchor once retention pruned the chain."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_samples import (
    bitwise_equal,
    build_chain,
    fingerprint,
    publish_chain,
    replica_at,
)

from deltasync.errors import ChainError, DeltaSyncError
from deltasync.store import LocalStore
from deltasync.wire.manifest import MANIFEST_PATH, Manifest
from deltasync.wire.policy import AnchorPolicy

CHAIN = build_chain(5)
OTHER = build_chain(5, run_id="run-b", seed=1)  # same model, another run
ENCODINGS = ["ctx", "ans", "packed", "coo"]


def _refused(replica, blob: bytes, error: type[DeltaSyncError] = DeltaSyncError) -> str:
    before = fingerprint(replica)
    with pytest.raises(error) as info:
        replica.update(blob)
    assert fingerprint(replica) == before
    return str(info.value)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_duplicate_delta_is_a_noop(encoding: str) -> None:
    replica = replica_at(CHAIN, 2)
    before = fingerprint(replica)
    assert replica.update(CHAIN.deltas[encoding, 2]) is False
    assert replica.update(CHAIN.anchors[2]) is False
    assert fingerprint(replica) == before


def test_duplicate_after_moving_on_is_refused_not_reapplied() -> None:
    """Delta 2 arriving again when the replica is at 3: its base (1) is gone."""
    replica = replica_at(CHAIN, 1)
    for version in (2, 3):
        assert replica.update(CHAIN.deltas["packed", version]) is True
    for encoding in ENCODINGS:
        assert "base 1" in _refused(replica, CHAIN.deltas[encoding, 2], ChainError)
    assert bitwise_equal(replica.tensors, CHAIN.states[3])


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_late_delta_is_refused(encoding: str) -> None:
    replica = replica_at(CHAIN, 4)
    _refused(replica, CHAIN.deltas[encoding, 3], ChainError)
    assert replica.version == 4 and bitwise_equal(replica.tensors, CHAIN.states[4])


def test_late_anchor_of_the_same_run_does_not_roll_back() -> None:
    """An anchor older than the version served is stale news, not a reason to go back."""
    replica = replica_at(CHAIN, 4)
    assert "older" in _refused(replica, CHAIN.anchors[2], ChainError)
    assert replica.version == 4 and bitwise_equal(replica.tensors, CHAIN.states[4])


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_delta_past_a_gap_is_refused(encoding: str) -> None:
    replica = replica_at(CHAIN, 1)
    assert "base 2" in _refused(replica, CHAIN.deltas[encoding, 3], ChainError)
    assert "base 3" in _refused(replica, CHAIN.deltas[encoding, 4], ChainError)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_delta_of_another_run_is_refused_even_on_a_matching_base(encoding: str) -> None:
    replica = replica_at(CHAIN, 1)
    assert "run-b" in _refused(replica, OTHER.deltas[encoding, 2], ChainError)


def test_delta_before_any_anchor_is_refused() -> None:
    assert "anchor" in _refused(replica_at(CHAIN, None), CHAIN.deltas["packed", 2], ChainError)


def test_anchor_of_another_run_switches_runs_cleanly() -> None:
    """A new run reaches old replicas through its anchor; its deltas then apply."""
    replica = replica_at(CHAIN, 4)
    assert replica.update(OTHER.anchors[2]) is True
    assert replica.update(OTHER.deltas["coo", 3]) is True
    assert (replica.run_id, replica.version) == ("run-b", 3)
    assert bitwise_equal(replica.tensors, OTHER.states[3])


FILES = [
    *((chain, "anchor", v) for chain in (CHAIN, OTHER) for v in chain.anchors),
    *((chain, enc, v) for chain in (CHAIN, OTHER) for enc, v in chain.deltas),
]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(order=st.lists(st.integers(0, len(FILES) - 1), min_size=1, max_size=14))
def test_any_order_of_notifications_never_misapplies(order: list[int]) -> None:
    """Any sequence of duplicate, late, early and foreign files: after each one the replica
    holds exactly the bytes of the (run, version) it reports, and within a run it never goes
    back."""
    replica = replica_at(CHAIN, None)
    for index in order:
        chain, kind, version = FILES[index]
        blob = chain.anchors[version] if kind == "anchor" else chain.deltas[kind, version]
        before = fingerprint(replica)
        try:
            replica.update(blob)
        except DeltaSyncError:
            assert fingerprint(replica) == before
            continue
        held = CHAIN if replica.run_id == CHAIN.run_id else OTHER
        assert bitwise_equal(replica.tensors, held.states[replica.version])
        if before[0] == replica.run_id:
            assert replica.version >= before[1]


def test_missed_versions_catch_up_through_the_chain(tmp_path) -> None:
    chain = build_chain(8)
    store = LocalStore(tmp_path)
    no_anchors = AnchorPolicy(interval=None, max_delta_fraction=None)
    publish_chain(store, chain, policy=no_anchors, versions=range(1, 4))
    replica = replica_at(chain, None)
    assert replica.sync(store) == [1, 2, 3]
    with_more = build_chain(8)  # the same states, published on by a resumed publisher
    publish_chain(store, with_more, policy=no_anchors, versions=range(4, 9))
    assert replica.sync(store) == [4, 5, 6, 7, 8]  # deltas only, no anchor download
    assert bitwise_equal(replica.tensors, chain.states[8])


def test_missed_versions_catch_up_through_the_next_anchor_once_pruned(tmp_path) -> None:
    chain = build_chain(8)
    store = LocalStore(tmp_path)
    policy = AnchorPolicy(interval=3, max_delta_fraction=None, keep_anchors=1)
    publish_chain(store, chain, policy=policy, versions=range(1, 3))
    replica = replica_at(chain, None)
    replica.sync(store)
    assert replica.version == 2
    publish_chain(store, chain, policy=policy, versions=range(3, 9))
    manifest = Manifest.from_json(store.get(MANIFEST_PATH))
    assert [a.version for a in manifest.anchors] == [7]
    assert [d.version for d in manifest.deltas] == [8]
    assert replica.sync(store) == [7, 8]  # deltas 3..6 are gone: the anchor bridges the gap
    assert bitwise_equal(replica.tensors, chain.states[8])


@pytest.mark.parametrize("keep_anchors", [1, 2])
def test_retention_leaves_only_referenced_files(tmp_path, keep_anchors: int) -> None:
    """Every anchor and delta in the bucket is named by the manifest (metrics records aside):
    with one anchor kept, the delta of an anchor version is never listed, so it must go too."""
    chain = build_chain(8)
    store = LocalStore(tmp_path)
    policy = AnchorPolicy(interval=3, max_delta_fraction=None, keep_anchors=keep_anchors)
    publish_chain(store, chain, policy=policy)
    manifest = Manifest.from_json(store.get(MANIFEST_PATH))
    files = {p for p in store.list("runs") if p.endswith(".safetensors")}
    assert files == manifest.referenced_paths()
