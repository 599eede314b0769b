"""Bucket faults under the publisher and the replica: failed and slow transfers, partial files and
a full disk. What `tests/deltasync/publisher/test_publisher.py` covers already (transient put
failures, a failure that surfaces, back-pressure, commit order) is not repeated here."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
from fault_store import Fault, FaultStore, connection_reset, enospc
from wire_samples import bitwise_equal, build_chain, fingerprint, publish_chain, replica_at

from deltasync.errors import FormatError, PublishError, StoreError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.store import RetryPolicy, retry
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, fetch_entry, read_manifest
from deltasync.wire.policy import AnchorPolicy

CHAIN = build_chain(5)
NO_ANCHORS = AnchorPolicy(interval=None, max_delta_fraction=None)


def _config(**kw) -> PublisherConfig:
    return PublisherConfig(**{"run_id": CHAIN.run_id, "policy": NO_ANCHORS} | kw)


def _wait_until(predicate, timeout: float = 30) -> None:
    event = threading.Event()  # not time.sleep: some tests replace it to record backoff delays
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        event.wait(0.005)
    raise AssertionError("condition not reached")


def _manifest(store) -> Manifest:
    return Manifest.from_json(store.get(MANIFEST_PATH))


def _causes(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    return chain


def _is_delta(version: int):
    return lambda path: f"/deltas/{version:08d}-" in path


# Reads


def test_failed_get_is_retried_then_applied(tmp_path: Path) -> None:
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=3, backoff_s=0.001))
    publish_chain(store, CHAIN, policy=NO_ANCHORS)
    fault = store.inject(Fault("get", _is_delta(5), times=2, error=connection_reset))
    replica = replica_at(CHAIN, 4)
    assert replica.sync(store) == [5]
    assert fault.hits == 2 and len([p for p in store.ops("get") if _is_delta(5)(p)]) == 3
    assert bitwise_equal(replica.tensors, CHAIN.states[5])


@pytest.mark.parametrize("target", ["delta", "manifest"])
def test_failed_get_gives_up_and_changes_nothing(tmp_path: Path, target: str) -> None:
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=3, backoff_s=0.001))
    publish_chain(store, CHAIN, policy=NO_ANCHORS)
    where = _is_delta(5) if target == "delta" else (lambda p: p == MANIFEST_PATH)
    store.inject(Fault("get", where, times=None, error=connection_reset))
    replica = replica_at(CHAIN, 4)
    before = fingerprint(replica)
    with pytest.raises(StoreError, match="gave up after 3 attempts") as info:
        replica.sync(store)
    assert isinstance(info.value.__cause__.__cause__, ConnectionResetError)
    assert fingerprint(replica) == before


# Slow uploads


def test_publish_returns_while_an_upload_is_in_flight(tmp_path: Path) -> None:
    """The training loop hands over version 3 while version 2's upload is still running."""
    store = FaultStore(tmp_path)
    gate = threading.Event()
    slow = store.inject(Fault("put", _is_delta(2), times=1, error=None, gate=gate))
    returned = {}
    with Publisher(store, _config(queue_size=2)) as publisher:
        publisher.publish(CHAIN.states[1]).result(timeout=30)
        second = publisher.publish(CHAIN.states[2])
        returned[2] = time.perf_counter()
        _wait_until(lambda: slow.blocked == 1)  # the worker is inside the slow put now
        third = publisher.publish(CHAIN.states[3])
        returned[3] = time.perf_counter()
        assert not second.done() and not third.done()
        gate.set()
        assert [second.result(timeout=30).version, third.result(timeout=30).version] == [2, 3]
    upload = next(c for c in store.calls if c.op == "put" and _is_delta(2)(c.path))
    assert upload.started < returned[3] < upload.finished  # publish(3) did not wait for it
    assert returned[2] < upload.finished
    replica = Replica()
    replica.sync(store)
    assert replica.version == 3 and bitwise_equal(replica.tensors, CHAIN.states[3])


# Partial files


def test_truncated_upload_is_never_committed(tmp_path: Path) -> None:
    """A store that leaves half a file behind on every failed attempt (a non-atomic copy)."""
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=2, backoff_s=0.001))
    publisher = Publisher(store, _config())
    publisher.publish(CHAIN.states[1]).result(timeout=30)
    store.inject(Fault("put", _is_delta(2), times=None, truncate=0.5))
    with pytest.raises(PublishError, match="version 2"):
        publisher.publish(CHAIN.states[2]).result(timeout=30)
    assert not [p for p in store.list("runs") if _is_delta(2)(p)]  # the half file is removed
    assert _manifest(store).latest_version == 1
    replica = replica_at(CHAIN, 1)
    before = fingerprint(replica)
    assert replica.sync(store) == [] and fingerprint(replica) == before
    store.clear()
    with pytest.raises(PublishError):  # surfaced once to the training loop
        publisher.publish(CHAIN.states[2])
    assert publisher.publish(CHAIN.states[2]).result(timeout=30).version == 2
    publisher.close()
    assert replica.sync(store) == [2]  # the same path, now whole, committed at last
    assert bitwise_equal(replica.tensors, CHAIN.states[2])


def test_committed_file_damaged_on_disk_is_refused(tmp_path: Path) -> None:
    store = FaultStore(tmp_path)
    publish_chain(store, CHAIN, policy=NO_ANCHORS)
    path = _manifest(store).deltas[-1].path
    full = Path(store.root, path)
    full.write_bytes(full.read_bytes()[:-7])  # bit rot, a bad disk, a half-finished rsync
    replica = replica_at(CHAIN, 4)
    before = fingerprint(replica)
    with pytest.raises(FormatError, match="does not match the manifest"):
        replica.sync(store)
    assert fingerprint(replica) == before


def test_leftover_temp_file_of_a_crash_is_invisible(tmp_path: Path) -> None:
    """A writer killed between write and rename leaves `.tmp-*` behind: never listed, never
    named by a manifest, and the next publish is unaffected."""
    store = FaultStore(tmp_path)
    publish_chain(store, CHAIN, policy=NO_ANCHORS, versions=range(1, 3))
    deltas = Path(store.root, "runs", CHAIN.run_id, "deltas")
    (deltas / ".tmp-crashed").write_bytes(CHAIN.deltas["packed", 3][:100])
    publish_chain(store, CHAIN, policy=NO_ANCHORS, versions=range(3, 4))
    assert not any(".tmp-" in p for p in store.list())
    replica = Replica()
    assert replica.sync(store) == [1, 2, 3]
    assert bitwise_equal(replica.tensors, CHAIN.states[3])


# A full disk


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Backoff delays asked of `time.sleep` by the retry loop (recorded, not slept)."""
    recorded: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", recorded.append)
    return recorded


FULL_DISK = {
    "delta-upload": ("put", _is_delta(2)),
    "anchor-upload": ("put", lambda p: "/anchors/00000002-" in p),
    "manifest-commit": ("publish", lambda p: p == MANIFEST_PATH),
}


@pytest.mark.parametrize("where", FULL_DISK, ids=FULL_DISK.keys())
def test_disk_full_retries_with_backoff_then_surfaces(tmp_path: Path, sleeps, where: str):
    """ENOSPC on every attempt: 4 attempts with doubling delays, then a `PublishError` that
    says why; the manifest stays at version 1; once space is back, versions 2 and 3 follow
    without a gap or a repeat."""
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=4, backoff_s=0.25))
    policy = AnchorPolicy(interval=1, max_delta_fraction=None)  # an anchor at every version
    publisher = Publisher(store, _config(policy=policy))
    publisher.publish(CHAIN.states[1]).result(timeout=30)
    op, match = FULL_DISK[where]
    full = store.inject(Fault(op, match, times=None, error=enospc))
    with pytest.raises(PublishError, match="gave up after 4 attempts") as info:
        publisher.publish(CHAIN.states[2]).result(timeout=30)
    assert full.hits == 4 and sleeps == [0.25, 0.5, 1.0]
    assert "No space left on device" in str(info.value)
    assert any(getattr(e, "errno", None) == errno.ENOSPC for e in _causes(info.value))
    assert read_manifest(store).latest_version == 1
    store.clear()
    with pytest.raises(PublishError):
        publisher.publish(CHAIN.states[2])
    records = [publisher.publish(CHAIN.states[v]).result(timeout=30) for v in (2, 3)]
    publisher.close()
    assert [r.version for r in records] == [2, 3]
    manifest = _manifest(store)
    assert manifest.latest_version == 3
    assert [a.version for a in manifest.anchors] == [2, 3]  # keep_anchors=2
    assert [d.version for d in manifest.deltas] == [3]  # the deltas after the oldest anchor
    metrics = store.list(f"runs/{CHAIN.run_id}/metrics")
    assert [int(Path(p).stem) for p in metrics] == [1, 2, 3]
    for entry in (*manifest.anchors, *manifest.deltas):  # every committed file is whole
        fetch_entry(store, entry)
    replica = Replica()
    replica.sync(store)
    assert replica.version == 3 and bitwise_equal(replica.tensors, CHAIN.states[3])


def test_disk_full_for_the_metrics_record_does_not_undo_the_commit(tmp_path: Path) -> None:
    """After the commit point only the metrics record fails: the version stays published."""
    store = FaultStore(tmp_path)
    store.inject(Fault("put", lambda p: "/metrics/00000002" in p, times=None, error=enospc))
    records = publish_chain(store, CHAIN, policy=NO_ANCHORS, versions=range(1, 4))
    assert [r.version for r in records] == [1, 2, 3]
    assert _manifest(store).latest_version == 3
    metrics = [Path(p).stem for p in store.list(f"runs/{CHAIN.run_id}/metrics")]
    assert metrics == ["00000001", "00000003"]
