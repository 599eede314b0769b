"""Manifest entries that point outside the bucket, into another run, at a URL or at a file that
is not this chain's: the replica refuses the manifest before it reads any file it names."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fault_store import FaultStore
from manifest_mutations import HOSTILE_PATHS
from wire_samples import bitwise_equal, build_chain, fingerprint, publish_chain, replica_at

from deltasync.errors import FormatError
from deltasync.store import RetryPolicy
from deltasync.wire.manifest import MANIFEST_PATH, Manifest

CHAIN = build_chain(5)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[FaultStore, bytes]:
    """Versions 1..5 (anchors 1 and 4 kept), with a file outside the bucket next to it."""
    root = tmp_path_factory.mktemp("paths")
    store = FaultStore(root / "bucket", retry=RetryPolicy(attempts=1))
    publish_chain(store, CHAIN)
    (root / "secret").write_text("outside the bucket")
    return store, store.get(MANIFEST_PATH)


@pytest.fixture
def bucket(published) -> Iterator[tuple[FaultStore, dict]]:
    """The bucket and its manifest as a JSON document to edit; the manifest is restored after."""
    store, raw = published
    yield store, json.loads(raw)
    store.publish(MANIFEST_PATH, raw)


def _sync_refused(store: FaultStore, doc: dict, start: int | None) -> str:
    store.publish(MANIFEST_PATH, json.dumps(doc).encode())
    store.calls.clear()
    replica = replica_at(CHAIN, start)
    before = fingerprint(replica)
    with pytest.raises(FormatError) as info:
        replica.sync(store)
    assert fingerprint(replica) == before
    assert store.ops("get") == [MANIFEST_PATH]  # nothing the manifest names was read
    return str(info.value)


@pytest.mark.parametrize("path", HOSTILE_PATHS.values(), ids=HOSTILE_PATHS.keys())
@pytest.mark.parametrize("entry", ["latest-delta", "latest-anchor"])
def test_hostile_entry_path_is_refused_before_any_read(bucket, entry: str, path: str) -> None:
    store, doc = bucket
    target, start = (
        (doc["deltas"][-1], 4) if entry == "latest-delta" else (doc["anchors"][-1], None)
    )
    target["path"] = path
    _sync_refused(store, doc, start)
    with pytest.raises(FormatError):
        Manifest.from_json(json.dumps(doc).encode())


def test_real_file_of_another_version_is_refused(bucket) -> None:
    """Delta 5's entry naming delta 4's (real, intact) file: each entry must be its own file."""
    store, doc = bucket
    doc["deltas"][-1]["path"] = doc["deltas"][-2]["path"]
    assert "version 5" in _sync_refused(store, doc, 4)


def test_anchor_listed_as_a_delta_is_refused(bucket) -> None:
    store, doc = bucket
    doc["deltas"][-1]["path"] = doc["anchors"][-1]["path"]
    _sync_refused(store, doc, 4)


def test_entry_of_another_run_is_refused(bucket, tmp_path) -> None:
    """A real file of run 'run-b' copied into the bucket and listed in run 'run's manifest."""
    store, doc = bucket
    other = build_chain(5, run_id="run-b", seed=1)
    other_store = FaultStore(tmp_path / "other")
    records = publish_chain(other_store, other, versions=range(1, 6))
    path = records[-1].delta_path
    store.put(path, other_store.get(path))
    doc["deltas"][-1] |= {
        "path": path,
        "digest": json.loads(other_store.get(MANIFEST_PATH))["deltas"][-1]["digest"],
    }
    assert "run-b" in _sync_refused(store, doc, 4)
    store.delete(path)


def test_untouched_manifest_still_syncs(bucket) -> None:
    store, _ = bucket
    replica = replica_at(CHAIN, 4)
    assert replica.sync(store) == [5]
    assert bitwise_equal(replica.tensors, CHAIN.states[5])
