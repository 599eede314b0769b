"""Store calls per version on every side, counted by `LatencyStore` around the real `Publisher`
and `Replica` over a folder bucket: a publisher's version, a replica's sync of one version and a
follower's poll each cost the fewest round trips the protocol allows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from deltasync import AnchorPolicy, Publisher, PublisherConfig, Replica
from deltasync.store import LocalStore
from deltasync.store.latency import Call, LatencyStore
from deltasync.wire.manifest import read_manifest_bytes


def kinds(calls: Sequence[Call]) -> Counter[str]:
    return Counter(f"{c.target}.{c.kind}" for c in calls)


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


def test_calls_per_version_on_every_side(tmp_path: Path, states) -> None:
    bucket = LocalStore(tmp_path)
    publisher_store, replica_store, poll_store = (
        LatencyStore(bucket, latency_s=0, bandwidth=None) for _ in range(3)
    )
    policy = AnchorPolicy(interval=2, keep_anchors=2)
    replica = Replica()
    per_version = []
    sides = (publisher_store, replica_store, poll_store)
    with Publisher(publisher_store, PublisherConfig("r", policy=policy)) as publisher:
        for state in states:
            marks = [len(s.calls) for s in sides]
            version = publisher.publish(state).result().version
            assert replica.sync(replica_store, target=version) == [version]
            read_manifest_bytes(poll_store)  # a follower's poll that finds nothing new
            per_version.append([kinds(s.calls[m:]) for s, m in zip(sides, marks, strict=True)])
    first, delta, anchor_kept, _, anchor_retires, _ = per_version
    # version 1: the claim reads the (missing) manifest once, then the anchor and the commit
    commit = {"manifest.swap": 1, "metrics.put": 1}
    assert first[0] == {"manifest.get": 1, "anchor.put": 1} | commit
    assert first[1] == {"manifest.get": 1, "anchor.get": 1}
    # a delta version: upload, commit, record; a driven sync: one manifest read, one file read
    assert delta[0] == {"delta.put": 1} | commit
    assert delta[1] == {"manifest.get": 1, "delta.get": 1}
    # an anchor version uploads both files; a live replica still moves by the delta
    assert anchor_kept[0] == {"delta.put": 1, "anchor.put": 1} | commit
    assert anchor_kept[1] == delta[1]
    # the third anchor retires the first and the deltas up to the second: one delete per file
    assert anchor_retires[0] == anchor_kept[0] | {"anchor.delete": 1, "delta.delete": 2}
    # a poll is one small read: the manifest, nothing else
    for sides in per_version:
        assert sides[2] == {"manifest.get": 1}
    manifest_size = (tmp_path / "manifest.json").stat().st_size
    assert poll_store.calls[-1].bytes == manifest_size < 10_000


def test_cold_start_by_parallel_ranges_is_bitwise(tmp_path: Path, states) -> None:
    bucket = LocalStore(tmp_path)
    with Publisher(bucket, PublisherConfig("r")) as publisher:
        publisher.publish(states[0]).result()
    one, ranged = (LatencyStore(bucket, latency_s=0, bandwidth=None) for _ in range(2))
    one.range_workers, ranged.range_bytes = 1, 4096
    replicas = [Replica(), Replica()]
    replicas[0].sync(one)
    replicas[1].sync(ranged)
    assert kinds(one.calls) == {"manifest.get": 1, "anchor.get": 1}
    assert kinds(ranged.calls)["anchor.get_range"] == -(-(2 * 128 * 256 + 2 * 256) // 4096)
    for name, tensor in replicas[0].tensors.items():
        assert torch.equal(tensor.view(torch.int16), replicas[1].tensors[name].view(torch.int16))
    assert replicas[0].state_digest == replicas[1].state_digest is not None
