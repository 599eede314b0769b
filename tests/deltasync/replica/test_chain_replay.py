"""50 versions of real AdamW steps through anchors and deltas: every reader is bitwise exact."""

from __future__ import annotations

import pytest
import torch
from model_steps import AdamWLoop

from bench.models.qwen3 import tiny_qwen3
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.wire.manifest import read_manifest
from deltasync.wire.policy import AnchorPolicy

POLICIES = {
    "interval": AnchorPolicy(interval=8, max_delta_fraction=None, keep_anchors=2),
    "adaptive": AnchorPolicy(interval=None, max_delta_fraction=0.25, keep_anchors=2),
}


def _assert_bitwise(replica: Replica, expected: dict[str, torch.Tensor]) -> None:
    assert replica.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("encoding", ["packed", "coo"])
def test_fifty_versions_replay_bitwise(tmp_path, policy, encoding):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-6)
    store = open_store(str(tmp_path / "bucket"))
    publisher = Publisher(store, PublisherConfig(run_id="run-a", encoding=encoding, policy=policy))
    live = Replica()
    kinds, densities = [], []
    for version in range(1, 51):
        if version > 1:
            loop.step()
        record = publisher.publish(model).result(timeout=60)
        assert record.version == version
        kinds.append(record.kind)
        densities.append(1 - record.sparsity)
        applied = live.sync(store)
        assert applied == [version]
        expected = Bf16Snapshot.capture(model).tensors
        _assert_bitwise(live, expected)
        if version == 37:
            joiner = Replica()
            joiner.sync(store)
            assert joiner.version == 37
            _assert_bitwise(joiner, expected)
    publisher.close()
    assert kinds[0] == "anchor"
    assert "delta+anchor" in kinds and kinds.count("delta") > 30
    assert min(densities[1:]) > 0 and max(densities[1:]) < 0.2  # realistic sparsity at lr 1e-6
    manifest = read_manifest(store)
    assert manifest is not None and len(manifest.anchors) == 2
    referenced = manifest.referenced_paths()
    files = [p for p in store.list("runs/run-a") if "/metrics/" not in p]
    assert sorted(files) == sorted(referenced)  # retention removed everything else
    assert len(store.list("runs/run-a/metrics")) == 50


def test_pipelined_publishes_chain_without_waiting(tmp_path):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-4)
    store = open_store(str(tmp_path / "bucket"))
    expected = {}
    with Publisher(store, PublisherConfig(run_id="run-p", queue_size=3)) as publisher:
        futures = []
        for version in range(1, 13):
            if version > 1:
                loop.step()
            futures.append(publisher.publish(model))
            expected[version] = Bf16Snapshot.capture(model).tensors
    assert [f.result().version for f in futures] == list(range(1, 13))
    replica = Replica()
    replica.sync(store)
    _assert_bitwise(replica, expected[12])
