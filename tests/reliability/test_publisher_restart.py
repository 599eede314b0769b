"""A trainer killed mid-upload or mid-commit and started again on the same bucket: the new
publisher resumes after the last committed version, the dead attempt's files are never named by
a manifest, and a new run id makes old replicas move over through an anchor, never a delta."""

from __future__ import annotations

import threading

import pytest
from fault_store import Fault, FaultStore
from wire_samples import bitwise_equal, build_chain, fingerprint, replica_at, stepped

from deltasync.errors import ChainError, FormatError, PublishError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore, RetryPolicy
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, fetch_entry
from deltasync.wire.policy import AnchorPolicy

CHAIN = build_chain(4)
POLICY = AnchorPolicy(interval=None, max_delta_fraction=None)
# What the restarted trainer publishes as version 3: not what the dead one was uploading.
RESUMED = {3: stepped(CHAIN.states[2], 999), 4: stepped(stepped(CHAIN.states[2], 999), 1000)}


def _config(run_id: str = CHAIN.run_id, **kw) -> PublisherConfig:
    return PublisherConfig(run_id=run_id, **{"policy": POLICY, **kw})


def _killed() -> BaseException:
    return ConnectionAbortedError("the trainer process is gone (injected)")


def _manifest(store) -> Manifest:
    return Manifest.from_json(store.get(MANIFEST_PATH))


def _start_dying(store: FaultStore, fault: Fault) -> tuple[Publisher, object, threading.Event]:
    """A publisher that committed versions 1 and 2, then hangs inside `fault` on version 3."""
    gate = threading.Event()
    fault.gate, fault.error = gate, _killed
    dying = Publisher(store, _config())
    for version in (1, 2):
        dying.publish(CHAIN.states[version]).result(timeout=30)
    store.inject(fault)
    future = dying.publish(CHAIN.states[3])
    event = threading.Event()
    for _ in range(6000):  # until the worker is stuck inside the fault
        if fault.blocked:
            break
        event.wait(0.005)
    assert fault.hits == fault.blocked == 1
    return dying, future, gate


def _bury(dying: Publisher, future, gate: threading.Event) -> None:
    """Let the abandoned worker fail (its process is gone) and stop its thread (test hygiene)."""
    gate.set()
    with pytest.raises(PublishError):
        future.result(timeout=30)
    dying.close(timeout=30)


@pytest.mark.parametrize(
    "fault",
    [
        Fault("publish", lambda p: p == MANIFEST_PATH),
        Fault("put", lambda p: "/deltas/00000003-" in p, truncate=0.5),
    ],
    ids=["killed-during-manifest-commit", "killed-during-delta-upload"],
)
def test_restart_resumes_after_the_last_commit(tmp_path, fault: Fault) -> None:
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=1))
    dying, future, gate = _start_dying(store, fault)
    leftovers = {p: store.get(p) for p in store.list("runs") if "/00000003-" in p}
    assert leftovers  # the dead attempt's delta (whole, or half of it) is in the bucket

    with Publisher(LocalStore(tmp_path), _config(takeover=True)) as restarted:
        assert restarted.publish(RESUMED[3]).result(timeout=30).version == 3
        assert restarted.publish(RESUMED[4]).result(timeout=30).version == 4
    _bury(dying, future, gate)

    manifest = _manifest(store)
    assert manifest.latest_version == 4 and [d.version for d in manifest.deltas] == [2, 3, 4]
    assert not leftovers.keys() & manifest.referenced_paths()  # never named by any commit
    files = {p for p in store.list("runs") if "/metrics/" not in p}
    assert files == manifest.referenced_paths()  # the takeover removed the dead attempt's
    for entry in (*manifest.anchors, *manifest.deltas):
        fetch_entry(store, entry)  # every committed file is whole and matches its digest
    live = replica_at(CHAIN, 2)  # the last version both trainers agree on
    assert live.sync(store) == [3, 4]  # the committed 3, not the dead attempt's
    assert bitwise_equal(live.tensors, RESUMED[4])
    cold = Replica()
    assert cold.sync(store) == [1, 2, 3, 4]
    assert bitwise_equal(cold.tensors, RESUMED[4])
    if fault.truncate is not None:  # half a file, should anything be handed it directly
        replica = replica_at(CHAIN, 2)
        before = fingerprint(replica)
        with pytest.raises(FormatError):
            replica.update(next(iter(leftovers.values())))
        assert fingerprint(replica) == before


@pytest.mark.parametrize(
    "fault",
    [
        Fault("put", lambda p: "/anchors/00000003-" in p),
        Fault("put", lambda p: "/metrics/00000003" in p),
        Fault("delete", lambda p: "/00000001-" in p),
    ],
    ids=["killed-during-anchor-upload", "killed-after-commit-in-metrics", "killed-in-retention"],
)
def test_killed_at_the_later_steps_of_the_commit_order(tmp_path, fault: Fault) -> None:
    """Delta, anchor, manifest, metrics record, retention deletes: killed at any of the later
    steps and restarted with `takeover`, the bucket replays to the new trainer's state and holds
    no chain file its manifest does not name."""
    policy = AnchorPolicy(interval=2, max_delta_fraction=None, keep_anchors=1)  # anchor at 3
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=1))
    gate = threading.Event()
    fault.gate, fault.error = gate, _killed
    dying = Publisher(store, _config(policy=policy))
    for version in (1, 2):
        dying.publish(CHAIN.states[version]).result(timeout=30)
    store.inject(fault)
    future = dying.publish(CHAIN.states[3])
    for _ in range(6000):  # until the worker is stuck inside the fault
        if fault.blocked:
            break
        threading.Event().wait(0.005)
    assert fault.blocked == 1
    committed = _manifest(store).latest_version  # 2, or 3 once the commit happened
    with Publisher(LocalStore(tmp_path), _config(policy=policy, takeover=True)) as restarted:
        record = restarted.publish(RESUMED[4]).result(timeout=30)
    assert record.version == committed + 1
    gate.set()  # the dead process's worker: whatever it does now must not harm the bucket
    future.exception(timeout=30)
    dying.close(timeout=30)
    manifest = _manifest(store)
    files = {p for p in store.list("runs") if "/metrics/" not in p}
    assert files == manifest.referenced_paths()
    replica = Replica()
    assert replica.sync(store)[-1] == record.version
    assert bitwise_equal(replica.tensors, RESUMED[4])
    assert replica.state_digest.hex() == manifest.version_digest(record.version)


def test_restart_with_a_new_run_id_moves_replicas_through_an_anchor(tmp_path) -> None:
    store = FaultStore(tmp_path, retry=RetryPolicy(attempts=1))
    dying, future, gate = _start_dying(store, Fault("publish", lambda p: p == MANIFEST_PATH))
    old = replica_at(CHAIN, 2)  # a live replica of the old run
    new_states = {1: stepped(CHAIN.states[2], 7), 2: stepped(stepped(CHAIN.states[2], 7), 8)}
    with Publisher(LocalStore(tmp_path), _config("run-2")) as restarted:
        records = [restarted.publish(new_states[v]).result(timeout=30) for v in (1, 2)]
    _bury(dying, future, gate)
    assert [r.version for r in records] == [1, 2]

    manifest = _manifest(store)
    assert manifest.run_id == "run-2"
    assert all(p.startswith("runs/run-2/") for p in manifest.referenced_paths())
    delta = fetch_entry(store, manifest.deltas[-1])
    before = fingerprint(old)
    with pytest.raises(ChainError, match="run-2"):  # base version 1 of another run
        old.update(delta, path=manifest.deltas[-1].path)
    assert fingerprint(old) == before
    assert old.sync(store) == [1, 2]  # the new run's anchor, then its delta
    assert old.run_id == "run-2" and bitwise_equal(old.tensors, new_states[2])


class _ReadLog(LocalStore):
    """A folder bucket that records the chain files it hands out."""

    def __init__(self, folder):
        super().__init__(str(folder))
        self.chain_reads: list[str] = []

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        if path != MANIFEST_PATH:
            self.chain_reads.append(path)
        return super().get(path, limit=limit)


@pytest.mark.parametrize("behind", [0, 1], ids=["current", "one-version-behind"])
def test_a_takeover_resumes_from_a_caller_s_replay_without_downloading_it_again(
    tmp_path, behind: int
) -> None:
    """The trainer replays the bucket to load its weights; handed that replica, the publisher
    fetches only what was committed since (nothing when current) and continues bitwise."""
    with Publisher(LocalStore(tmp_path), _config()) as first:
        for version in (1, 2, 3):
            first.publish(CHAIN.states[version]).result(timeout=30)
    store = _ReadLog(tmp_path)
    replayed = Replica()
    replayed.sync(LocalStore(tmp_path), target=3 - behind)
    with Publisher(store, _config(takeover=True)) as taker:
        taker.resume_from(replayed)
        assert taker.publish(RESUMED[4]).result(timeout=30).version == 4
    [third] = [d.files[0].path for d in _manifest(store).deltas if d.version == 3]
    assert store.chain_reads == [third][:behind]
    cold = Replica()
    cold.sync(LocalStore(tmp_path))
    assert cold.version == 4 and bitwise_equal(cold.tensors, RESUMED[4])
