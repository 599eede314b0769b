"""Publisher fencing: one owner per run, a commit is a compare-and-swap on the manifest, a
takeover fences the previous owner at once, and a reader on a fork is refused."""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import time
from collections.abc import Callable

import pytest
from racing import POLICY, race
from wire_samples import RUN, bitwise_equal, build_chain, stepped

from deltasync.errors import ChainError, Fenced, PublishError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore, open_store
from deltasync.wire.digests import bytes_digest
from deltasync.wire.garbage import find_unreferenced
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, read_manifest

CHAIN = build_chain(6)


def _config(**kw) -> PublisherConfig:
    return PublisherConfig(RUN, policy=POLICY, write_metrics=False, **kw)


def _publish(store, states, **kw) -> Publisher:
    publisher = Publisher(store, _config(**kw))
    for state in states:
        publisher.publish(state).result(timeout=30)
    return publisher


def test_a_second_publisher_of_the_run_is_refused_in_one_line(tmp_path):
    store = LocalStore(tmp_path)
    first = _publish(store, [CHAIN.states[1], CHAIN.states[2]])
    before = store.get(MANIFEST_PATH)
    second = Publisher(store, _config())
    with pytest.raises(PublishError) as info:
        second.claim()
    message = str(info.value)
    assert "\n" not in message and "--takeover" in message and "version 2" in message
    assert store.get(MANIFEST_PATH) == before  # nothing changed
    assert first.publish(CHAIN.states[3]).result(timeout=30).version == 3  # the owner goes on
    first.close()


def test_takeover_fences_the_old_publisher_at_once(tmp_path):
    store = LocalStore(tmp_path)
    old = _publish(store, [CHAIN.states[1], CHAIN.states[2]])
    new = Publisher(store, _config(takeover=True))
    new.claim()
    manifest = read_manifest(store)
    assert (manifest.latest_version, manifest.epoch) == (2, 2)  # same versions, next epoch
    with pytest.raises(Fenced) as info:  # the old one's very next commit
        old.publish(CHAIN.states[3]).result(timeout=30)
    message = str(info.value)
    assert "\n" not in message and "epoch 2" in message and "--takeover" in message
    with pytest.raises(Fenced):  # and every later one: it never commits again
        old.publish(CHAIN.states[3])
    assert new.publish(CHAIN.states[3]).result(timeout=30).version == 3
    new.close()
    old.close()
    replica = Replica()
    assert replica.sync(store) == [1, 2, 3]
    assert bitwise_equal(replica.tensors, CHAIN.states[3])
    manifest = read_manifest(store)
    # the old one's upload of version 3 lost to the new one's: garbage that `gc` finds
    (orphan,) = set(store.list(f"runs/{RUN}")) - manifest.referenced_paths()
    assert find_unreferenced(store, manifest) == [orphan] and "/00000003-" in orphan


def test_every_commit_names_the_manifest_it_replaced(tmp_path):
    store = LocalStore(tmp_path)
    publisher = Publisher(store, _config())
    seen = [None]
    for version in (1, 2, 3):
        publisher.publish(CHAIN.states[version]).result(timeout=30)
        seen.append(store.get(MANIFEST_PATH))
    publisher.close()
    for before, after in itertools.pairwise(seen):
        expected = Manifest.from_json(after)
        assert expected.previous == (None if before is None else bytes_digest(before))
        assert expected.epoch == 1


def test_a_new_run_replaces_another_and_fences_its_publisher(tmp_path):
    store = LocalStore(tmp_path)
    old = _publish(store, [CHAIN.states[1]])
    new = Publisher(store, PublisherConfig("run-2", policy=POLICY, write_metrics=False))
    assert new.publish(CHAIN.states[4]).result(timeout=30).version == 1
    with pytest.raises(Fenced, match="run run-2 at version 1"):
        old.publish(CHAIN.states[2]).result(timeout=30)
    new.close()
    old.close()
    assert read_manifest(store).run_id == "run-2" and read_manifest(store).epoch == 2


def test_a_commit_lost_between_read_and_write_is_fenced(tmp_path):
    """The compare-and-swap itself: another writer replaced the manifest after this publisher
    last wrote it; the commit is refused, and its upload is left for whoever owns the bucket
    now (it could be uploading the same file), whose takeover removes it."""
    store = LocalStore(tmp_path)
    publisher = _publish(store, [CHAIN.states[1]])
    intruder = read_manifest(store).committed_after(store.get(MANIFEST_PATH), 7)
    store.publish(MANIFEST_PATH, intruder.to_json())
    with pytest.raises(Fenced, match="epoch 7"):
        publisher.publish(CHAIN.states[2]).result(timeout=30)
    publisher.close()
    assert read_manifest(store) == intruder
    left = [p for p in store.list("runs") if "/deltas/" in p]
    assert len(left) == 1 and find_unreferenced(store, intruder) == []  # in flight: not gc's
    Publisher(store, _config(takeover=True)).claim()
    assert store.list("runs") == sorted(intruder.referenced_paths())


def test_a_file_vanishing_during_the_takeover_replay_is_a_one_line_refusal(tmp_path):
    """Retention of a newer owner can delete a delta while this takeover replays the chain
    (the race below found it): `publish` refuses in one line and commits nothing."""
    store = LocalStore(tmp_path)
    _publish(store, [CHAIN.states[1], CHAIN.states[2], CHAIN.states[3]]).close()
    manifest = read_manifest(store)
    gone = manifest.deltas[-1].files[0].path
    (tmp_path / gone).unlink()
    taker = Publisher(store, _config(takeover=True))
    with pytest.raises(PublishError) as info:
        taker.publish(CHAIN.states[4])
    message = str(info.value)
    assert "\n" not in message and gone in message and "take the run over again" in message
    after = read_manifest(store)  # taken over (next epoch), no version added
    assert (after.latest_version, after.epoch) == (3, manifest.epoch + 1)
    taker.close()


class _ThenAfterSwap(LocalStore):
    """A folder that runs `then` once, right after its next manifest swap succeeds."""

    then: Callable[[], None] | None = None

    def swap(self, path: str, data: bytes, *, expected: bytes | None) -> None:
        super().swap(path, data, expected=expected)
        then, self.then = self.then, None
        if then is not None:
            then()


def test_a_takeover_never_removes_what_a_newer_owner_committed(tmp_path):
    """Takeover A swaps the manifest in; before its clean-up runs, takeover B fences A and
    commits the next version: A's clean-up leaves B's file alone, while B, the owner now, removes
    the older attempt's upload (the 100-round race below found B's file deleted)."""
    _publish(LocalStore(tmp_path), [CHAIN.states[1], CHAIN.states[2]]).close()
    older_attempt = tmp_path / "runs" / RUN / "deltas" / "00000003-0123456789ab.safetensors"
    older_attempt.write_bytes(b"an upload its publisher never committed")
    store = _ThenAfterSwap(tmp_path)
    store.then = lambda: _publish(LocalStore(tmp_path), [CHAIN.states[3]], takeover=True).close()
    Publisher(store, _config(takeover=True)).claim()
    replica = Replica()
    assert replica.sync(LocalStore(tmp_path)) == [1, 2, 3]
    assert bitwise_equal(replica.tensors, CHAIN.states[3])
    manifest = read_manifest(LocalStore(tmp_path))
    assert manifest.epoch == 3
    assert not older_attempt.exists() and find_unreferenced(LocalStore(tmp_path), manifest) == []


def test_two_publisher_processes_race_for_100_rounds(tmp_path):
    """Two processes take the run over and publish every round: a version is committed once
    or not at all, the loser's error is one line, and the chain replays bitwise."""
    rounds = 100
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    sides = [
        context.Process(target=race, args=(side, str(tmp_path), rounds, barrier, results))
        for side in (1, 2)
    ]
    for process in sides:
        process.start()
    outcomes = []
    deadline = time.monotonic() + 600
    try:
        while len(outcomes) < 2 * rounds:
            try:
                outcomes.append(results.get(timeout=1))
            except queue.Empty:  # a side that died before its last round ends the wait at once
                dead = [
                    process.exitcode
                    for side, process in enumerate(sides, start=1)
                    if process.exitcode is not None and sum(o[1] == side for o in outcomes) < rounds
                ]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"racers stopped (exit {dead}) after {len(outcomes)} outcomes")
                continue
            assert outcomes[-1][2] != "crashed", outcomes[-1]
    finally:
        for process in sides:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    committed: dict[int, set[str]] = {}
    losses = []
    for _round, _side, kind, detail in outcomes:
        if kind == "committed":
            committed.setdefault(detail[0], set()).add(detail[1])
        else:
            losses.append(detail)
    assert all(len(digests) == 1 for digests in committed.values()), committed
    assert losses and all("\n" not in loss for loss in losses)
    manifest = read_manifest(open_store(str(tmp_path)))
    assert manifest.latest_version == max(committed) == len(committed)
    replica = Replica()
    replica.sync(open_store(str(tmp_path)))
    assert replica.state_digest.hex() == next(iter(committed[manifest.latest_version]))
    for entry in (*manifest.anchors, *manifest.deltas):  # retained versions are the winners'
        assert {entry.state_digest} == committed[entry.version]


def test_a_reader_on_a_fork_is_refused_before_downloading(tmp_path):
    """Best-effort stores (Hub buckets) can lose a race: a replica holding the other writer's
    version 2 is told so by the digests, not handed a delta it cannot verify."""
    store = LocalStore(tmp_path)
    publisher = _publish(store, [CHAIN.states[1], CHAIN.states[2], CHAIN.states[3]])
    publisher.close()
    forked = Replica()
    other = Publisher(LocalStore(tmp_path / "other"), _config())
    other.publish(CHAIN.states[1]).result(timeout=30)
    other.publish(stepped(CHAIN.states[1], 77)).result(timeout=30)
    other.close()
    forked.sync(LocalStore(tmp_path / "other"))
    assert forked.version == 2
    with pytest.raises(ChainError, match="fork"):
        forked.sync(store)
    assert forked.version == 2
