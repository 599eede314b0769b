"""Fuzzing the manifest, the bucket's commit point: a hostile manifest is refused with a
`FormatError` (or the catch-up with a `DeltaSyncError`) before any file it names is read, and a
replica syncing against it either ends bitwise at a real version or is left unchanged."""

from __future__ import annotations

import pytest
from fault_store import MemoryFaultStore
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from manifest_mutations import manifest_mutation
from wire_samples import bitwise_equal, build_chain, fingerprint, publish_chain, replica_at

from deltasync.errors import ChainError, DeltaSyncError, FormatError
from deltasync.store import RetryPolicy, validate_path
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, file_path

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHAIN = build_chain(8)


@pytest.fixture(scope="module")
def bucket():
    """A bucket the real publisher wrote (anchors at 1, 4, 7; retention keeps 4 and 7), in
    memory: each example rewrites the manifest twice, and fsync would dominate the runtime."""
    store = MemoryFaultStore(retry=RetryPolicy(attempts=1))
    publish_chain(store, CHAIN)
    files = frozenset(p for p in store.list() if p.endswith(".safetensors"))
    yield store, store.get(MANIFEST_PATH), files
    store.remove()


def test_the_real_manifest_is_accepted(bucket) -> None:
    store, raw, files = bucket
    manifest = Manifest.from_json(raw)
    assert [a.version for a in manifest.anchors] == [4, 7]
    assert manifest.referenced_paths() <= files
    replica = replica_at(CHAIN, None)
    assert replica.sync(store) == [7, 8]


@settings(FUZZ, max_examples=1500)
@given(raw=st.data())
def test_fuzz_manifest_parse(bucket, raw) -> None:
    """`Manifest.from_json` raises `FormatError` only; what it accepts is self-consistent and
    names only this run's canonical file paths; planning a catch-up raises `ChainError` only."""
    data = raw.draw(manifest_mutation(bucket[1]))
    try:
        manifest = Manifest.from_json(data)
    except FormatError as exc:
        event(f"refused: {' '.join(w for w in str(exc).split() if w.isalpha())[:40]}")
        return
    event("accepted")
    entries = (*manifest.anchors, *manifest.deltas)
    for entry in entries:
        for index, file in enumerate(entry.files):
            validate_path(file.path)
            part = None if entry.parts is None else (index, len(entry.parts))
            assert file.path == file_path(
                manifest.run_id, entry.kind, entry.version, file.digest, part
            )
    versions = [d.version for d in manifest.deltas]
    assert versions == list(range(versions[0], versions[0] + len(versions))) if versions else True
    assert manifest.latest_version == max(e.version for e in entries)
    for reader in [(None, None), ("run", 1), ("run", 5), ("run", 8), ("other", 8), ("run", 99)]:
        try:
            plan = manifest.plan(*reader)
        except ChainError:
            continue
        assert all(e in entries for e in plan)


@settings(FUZZ, max_examples=1000)
@given(data=st.data(), start=st.sampled_from([None, 2, 6, 8]))
def test_fuzz_manifest_through_replica(bucket, data, start) -> None:
    """A replica syncing against a hostile manifest reads only real files of this run, and ends
    either bitwise at the version it reports or exactly where it was."""
    store, raw, files = bucket
    mutated = data.draw(manifest_mutation(raw))
    replica = replica_at(CHAIN, start)
    before = fingerprint(replica)
    store.publish(MANIFEST_PATH, mutated)
    store.calls.clear()
    try:
        replica.sync(store)
    except DeltaSyncError as exc:
        event(f"refused: {type(exc).__name__}")
        assert fingerprint(replica) == before
    else:
        event("synced" if fingerprint(replica) != before else "nothing to do")
        assert replica.run_id == CHAIN.run_id
        assert bitwise_equal(replica.tensors, CHAIN.states[replica.version])
    finally:
        store.publish(MANIFEST_PATH, raw)
    reads = store.ops("get")
    assert reads[:1] == [MANIFEST_PATH]
    assert set(reads[1:]) <= files, f"read outside the chain: {set(reads[1:]) - files}"
