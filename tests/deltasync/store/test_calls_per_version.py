"""Store calls per version on every side, counted by `LatencyStore` around the real `Publisher`
and `Replica` over a folder bucket: a publisher's version, a driven replica's sync of one version
and a follower's poll and sync each cost the fewest round trips the protocol allows, and a driven
replica reads the delta it was told of beside the manifest (`replica.driven`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from deltasync import AnchorPolicy, Publisher, PublisherConfig, Replica
from deltasync.errors import FormatError
from deltasync.store import LocalStore
from deltasync.store.latency import Call, LatencyStore
from deltasync.wire.manifest import largest_file, read_manifest, read_manifest_bytes
from deltasync.wire.metrics import SyncRecord


def kinds(calls: Sequence[Call]) -> Counter[str]:
    return Counter(f"{c.target}.{c.kind}" for c in calls)


def named(record: SyncRecord) -> str:
    """The file a trainer names when it drives a replica to `record`'s version."""
    return record.delta_path or record.anchor_path  # type: ignore[return-value]


@pytest.fixture
def states() -> list[dict[str, torch.Tensor]]:
    """Six versions of a small model; each step changes a few elements."""
    generator = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(128, 256, generator=generator).to(torch.bfloat16),
        "b": torch.randn(256, generator=generator).to(torch.bfloat16),
    }
    out = []
    for step in range(6):
        state["a"][step, :5] += 1
        out.append({n: t.clone() for n, t in state.items()})
    return out


@pytest.fixture
def published(tmp_path: Path, states) -> tuple[LocalStore, list[SyncRecord]]:
    """A bucket holding three versions (an anchor, then two deltas)."""
    bucket = LocalStore(tmp_path / "bucket")
    with Publisher(bucket, PublisherConfig("r")) as publisher:
        records = [publisher.publish(state).result() for state in states[:3]]
    return bucket, records


def at_version(bucket: LocalStore, version: int) -> Replica:
    replica = Replica()
    assert replica.sync(bucket, target=version)[-1] == version
    return replica


def test_calls_per_version_on_every_side(tmp_path: Path, states) -> None:
    bucket = LocalStore(tmp_path)
    publisher_store, driven_store, follower_store = (
        LatencyStore(bucket, latency_s=0, bandwidth=None) for _ in range(3)
    )
    policy = AnchorPolicy(interval=2, keep_anchors=2)
    driven, follower = Replica(), Replica()
    per_version = []
    sides = (publisher_store, driven_store, follower_store)
    with Publisher(publisher_store, PublisherConfig("r", policy=policy)) as publisher:
        for state in states:
            marks = [len(s.calls) for s in sides]
            record = publisher.publish(state).result()
            version = record.version
            assert driven.sync(driven_store, target=version, path=named(record)) == [version]
            poll = read_manifest_bytes(follower_store)  # serve --follow: its poll, then a sync
            assert follower.sync(follower_store, manifest=poll) == [version]  # from those bytes
            read_manifest_bytes(follower_store)  # the next poll finds nothing new
            publisher.flush()  # retention runs after the version's future resolved
            per_version.append([kinds(s.calls[m:]) for s, m in zip(sides, marks, strict=True)])
    first, delta, anchor_kept, _, anchor_retires, _ = per_version
    # version 1: the claim reads the (missing) manifest once, then the anchor and the commit
    commit = {"manifest.swap": 1, "metrics.put": 1}
    assert first[0] == {"manifest.get": 1, "anchor.put": 1} | commit
    assert first[1] == {"manifest.get": 1, "anchor.get_range": 1}  # a small anchor: one read
    # a delta version: upload, commit, record; a driven sync: one manifest read, one file read
    # (at once: see below); a follower: its poll, the file, its next (idle) poll
    assert delta[0] == {"delta.put": 1} | commit
    assert delta[1] == {"manifest.get": 1, "delta.get": 1}
    assert delta[2] == {"manifest.get": 2, "delta.get": 1}
    # an anchor version uploads both files; a live replica still moves by the delta
    assert anchor_kept[0] == {"delta.put": 1, "anchor.put": 1} | commit
    assert anchor_kept[1] == delta[1] and anchor_kept[2] == delta[2]
    # the third anchor retires the first and the deltas up to the second: once the manifest
    # is seen to be still the publisher's, one delete per file
    retired = {"manifest.get": 1, "anchor.delete": 1, "delta.delete": 2}
    assert anchor_retires[0] == anchor_kept[0] | retired
    manifest_size = (tmp_path / "manifest.json").stat().st_size
    assert follower_store.calls[-1].bytes == manifest_size < 10_000  # an idle poll: one read


def test_a_driven_sync_reads_the_named_delta_beside_the_manifest(published) -> None:
    """The delta's read starts before the manifest's answer: one round trip after the commit
    (plus the transfer), not two. Without a path the reads are one after the other."""
    bucket, records = published
    for path, overlap in ((named(records[1]), True), (None, False)):
        replica = at_version(bucket, 1)
        store = LatencyStore(bucket, latency_s=0.1, bandwidth=None)
        assert replica.sync(store, target=2, path=path) == [2]
        assert kinds(store.calls) == {"manifest.get": 1, "delta.get": 1}
        manifest, delta = (
            next(c for c in store.calls if c.target == t) for t in ("manifest", "delta")
        )
        assert (delta.started < manifest.at) is overlap
        assert replica.state_digest.hex() == read_manifest(bucket).version_digest(2)


@pytest.mark.parametrize(("held", "target"), [(None, 1), (1, 3)], ids=["anchor", "two-deltas"])
def test_nothing_is_read_ahead_unless_the_named_file_is_the_whole_plan(
    published, held, target
) -> None:
    """An anchor, or a delta that is one of several files of the plan, is read once the
    manifest planned it: never twice, never for nothing."""
    bucket, records = published
    replica = Replica() if held is None else at_version(bucket, held)
    store = LatencyStore(bucket, latency_s=0.05, bandwidth=None)
    assert replica.sync(store, target=target, path=named(records[target - 1]))[-1] == target
    manifest = next(c for c in store.calls if c.target == "manifest")
    files = [c for c in store.calls if c.target != "manifest"]
    assert [c.version for c in files] == ([1] if held is None else [2, 3])
    assert all(c.started >= manifest.at for c in files)


class FlippedOnce(LatencyStore):
    """Hands back the first read of a delta with one byte flipped (a read that went wrong)."""

    flipped = 0

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        data = super().get(path, limit=limit)
        if "/deltas/" in path and not self.flipped:
            self.flipped += 1
            return data[:-1] + bytes([data[-1] ^ 1])
        return data


def test_read_ahead_bytes_that_do_not_match_the_manifest_are_dropped_and_read_again(
    published, caplog
) -> None:
    bucket, records = published
    replica = at_version(bucket, 1)
    store = FlippedOnce(bucket, latency_s=0, bandwidth=None)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        assert replica.sync(store, target=2, path=named(records[1])) == [2]
    assert store.flipped == 1 and kinds(store.calls) == {"manifest.get": 1, "delta.get": 2}
    assert any("do not match the manifest" in r.getMessage() for r in caplog.records)
    assert replica.state_digest.hex() == read_manifest(bucket).version_digest(2)


def test_a_named_file_whose_bytes_differ_is_refused_after_both_reads(published) -> None:
    """The object itself differs from its manifest entry: the bytes read ahead are dropped,
    the planned fetch refuses it as always, and the replica keeps what it held."""
    bucket, records = published
    replica = at_version(bucket, 1)
    before = replica.state_digest
    target = Path(bucket.root) / named(records[1])
    data = target.read_bytes()
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    store = LatencyStore(bucket, latency_s=0, bandwidth=None)
    with pytest.raises(FormatError, match="does not match the manifest"):
        replica.sync(store, target=2, path=named(records[1]))
    assert kinds(store.calls) == {"manifest.get": 1, "delta.get": 2}
    assert (replica.version, replica.state_digest) == (1, before)


class ReadsCounted(LocalStore):
    """A folder bucket that records how many bytes each read of an object returned."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.reads: list[tuple[str, int]] = []

    def _read(self, full: str, end: int | None) -> bytes:
        data = super()._read(full, end)
        self.reads.append((full[len(self.root) + 1 :], len(data)))
        return data


def test_a_hostile_object_at_the_named_path_is_not_read_past_the_bound(published) -> None:
    """An object far larger than any delta of the held model sits at the named path: the read
    ahead stops one byte past that bound, the planned fetch one byte past the declared size."""
    bucket, records = published
    replica = at_version(bucket, 1)
    path = named(records[1])
    (Path(bucket.root) / path).write_bytes(b"\0" * (8 << 20))
    store = ReadsCounted(Path(bucket.root))
    with pytest.raises(FormatError, match="does not match the manifest"):
        replica.sync(store, target=2, path=path)
    bound = largest_file("delta", replica.sink.shapes())
    assert bound < 1 << 20
    assert sorted(n for p, n in store.reads if p == path) == [records[1].delta_bytes + 1, bound + 1]
    assert replica.version == 1


def test_a_followers_manifest_bytes_are_checked_as_a_read_would_be(published) -> None:
    bucket, _ = published
    replica = at_version(bucket, 1)
    store = LatencyStore(bucket, latency_s=0, bandwidth=None)
    with pytest.raises(FormatError, match="manifest"):
        replica.sync(store, manifest=b'{"protocol": "deltasync/5"')
    assert store.calls == [] and replica.version == 1
    assert replica.sync(store, manifest=bucket.get("manifest.json")) == [2, 3]
    assert kinds(store.calls) == {"delta.get": 2}


def test_cold_start_by_parallel_ranges_is_bitwise(tmp_path: Path, states, monkeypatch) -> None:
    monkeypatch.setattr("deltasync.wire.stored.HEAD_BYTES", 4096)
    bucket = LocalStore(tmp_path)
    with Publisher(bucket, PublisherConfig("r")) as publisher:
        publisher.publish(states[0]).result()
    one, ranged = (LatencyStore(bucket, latency_s=0, bandwidth=None) for _ in range(2))
    one.range_workers, ranged.range_bytes = 1, 4096
    anchor_bytes = read_manifest(bucket).anchors[0].bytes
    replicas = [Replica(), Replica()]
    replicas[0].sync(one)
    replicas[1].sync(ranged)
    assert kinds(one.calls) == {"manifest.get": 1, "anchor.get_range": 2}  # head, then the rest
    assert kinds(ranged.calls)["anchor.get_range"] == -(-anchor_bytes // 4096)
    for name, tensor in replicas[0].tensors.items():
        assert torch.equal(tensor.view(torch.int16), replicas[1].tensors[name].view(torch.int16))
    assert replicas[0].state_digest == replicas[1].state_digest is not None
