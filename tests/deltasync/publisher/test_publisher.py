"""Background publishing: back-pressure, retries, failures that surface, resume, metrics."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from model_steps import AdamWLoop, tiny_qwen3

from deltasync.errors import PublishError, StoreError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore, RetryPolicy
from deltasync.wire.manifest import MANIFEST_PATH, read_manifest
from deltasync.wire.policy import AnchorPolicy


class FlakyStore(LocalStore):
    """A folder whose writes fail on demand (each attempt counts), or block until released."""

    def __init__(self, folder, attempts: int = 4):
        super().__init__(folder, retry=RetryPolicy(attempts=attempts, backoff_s=0.001))
        self.fail_next = 0
        self.fail_always = False
        self.gate = threading.Event()
        self.gate.set()
        self.puts: list[str] = []

    def _write(self, full, data):
        self.gate.wait(timeout=30)
        path = full[len(self.root) + 1 :]
        if self.fail_always or self.fail_next > 0:
            self.fail_next -= 1
            raise StoreError("injected failure", path=path)
        self.puts.append(path)
        super()._write(full, data)


def _config(**kw):
    return PublisherConfig(run_id="run", **kw)


def _equal(replica, model):
    expected = Bf16Snapshot.capture(model).tensors
    return all(
        torch.equal(replica.tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected.items()
    )


def test_transient_failures_are_retried(tmp_path):
    store = FlakyStore(tmp_path)
    model = tiny_qwen3()
    with Publisher(store, _config()) as publisher:
        publisher.publish(model).result(timeout=30)
        store.fail_next = 3
        AdamWLoop(model, lr=1e-3).step()
        assert publisher.publish(model).result(timeout=30).version == 2
    replica = Replica()
    replica.sync(store)
    assert replica.version == 2 and _equal(replica, model)


def test_failure_surfaces_and_publishing_resumes_without_skipping(tmp_path):
    store = FlakyStore(tmp_path, attempts=2)
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    publisher = Publisher(store, _config())
    publisher.publish(model).result(timeout=30)
    store.fail_always = True
    loop.step()
    future = publisher.publish(model)
    with pytest.raises(PublishError, match="version 2"):
        future.result(timeout=30)
    assert read_manifest(store).latest_version == 1  # nothing half-committed
    loop.step()
    with pytest.raises(PublishError):  # surfaced once to a caller that ignored the future
        publisher.publish(model)
    store.fail_always = False
    record = publisher.publish(model).result(timeout=30)
    assert record.version == 2  # not skipped, and the delta is relative to committed version 1
    publisher.close()
    replica = Replica()
    replica.sync(store)
    assert replica.version == 2 and _equal(replica, model)


def test_full_queue_applies_back_pressure(tmp_path):
    store = FlakyStore(tmp_path)
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    publisher = Publisher(store, _config(queue_size=1))
    publisher.publish(model).result(timeout=30)
    store.gate.clear()  # uploads stall
    loop.step()
    publisher.publish(model)  # taken by the worker, stuck in put
    loop.step()
    publisher.publish(model)  # fills the queue
    loop.step()
    blocked = threading.Thread(target=publisher.publish, args=(model,))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # the training loop waits instead of queueing without bound
    store.gate.set()
    blocked.join(timeout=30)
    assert not blocked.is_alive()
    publisher.close()
    assert read_manifest(store).latest_version == 4


def test_restart_resumes_the_run_from_the_manifest(tmp_path):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    with Publisher(LocalStore(tmp_path), _config()) as publisher:
        for _ in range(3):
            publisher.publish(model)
            loop.step()
    with Publisher(LocalStore(tmp_path), _config(takeover=True)) as restarted:
        record = restarted.publish(model).result(timeout=30)
    assert record.version == 4 and record.kind.startswith("delta")
    replica = Replica()
    replica.sync(LocalStore(tmp_path))
    assert _equal(replica, model)


def test_new_run_starts_over_and_old_readers_refuse_its_deltas(tmp_path):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    store = LocalStore(tmp_path)
    with Publisher(store, _config()) as publisher:
        publisher.publish(model)
        loop.step()
        publisher.publish(model)
    old = Replica()
    old.sync(store)
    with Publisher(store, PublisherConfig(run_id="run-2")) as publisher:
        assert publisher.publish(model).result(timeout=30).version == 1
        loop.step()
        publisher.publish(model)
    assert read_manifest(store).run_id == "run-2"
    assert old.sync(store) == [1, 2]  # the anchor of the new run, then its delta
    assert old.run_id == "run-2" and _equal(old, model)


def test_metrics_record_per_version(tmp_path):
    model = tiny_qwen3()
    store = LocalStore(tmp_path)
    with Publisher(store, _config(policy=AnchorPolicy(interval=2))) as publisher:
        publisher.publish(model)
        AdamWLoop(model, lr=1e-3).step()
        publisher.publish(model)
        AdamWLoop(model, lr=1e-3).step()
        publisher.publish(model)
    records = [json.loads(store.get(p)) for p in store.list("runs/run/metrics")]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert [r["kind"] for r in records] == ["anchor", "delta", "delta+anchor"]
    assert records[1]["delta_bytes"] > 0 and 0 < records[1]["sparsity"] < 1
    assert all(r["upload_s"] >= 0 and r["encode_s"] > 0 for r in records)
    assert records[0]["full_bytes"] == 2 * sum(p.numel() for p in model.parameters())


def test_manifest_is_written_last(tmp_path):
    store = FlakyStore(tmp_path)
    model = tiny_qwen3()
    with Publisher(store, _config()) as publisher:
        publisher.publish(model)
        AdamWLoop(model, lr=1e-3).step()
        publisher.publish(model)
    commits = [i for i, p in enumerate(store.puts) if p == MANIFEST_PATH]
    files = [i for i, p in enumerate(store.puts) if p.endswith(".safetensors")]
    assert len(commits) == 2 and files[0] < commits[0] < files[1] < commits[1]


def test_versions_queued_behind_a_failure_are_dropped_not_misapplied(tmp_path):
    store = FlakyStore(tmp_path, attempts=1)
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    publisher = Publisher(store, _config(queue_size=4))
    publisher.publish(model).result(timeout=30)
    store.gate.clear()
    store.fail_always = True
    futures = []
    for _ in range(3):
        loop.step()
        futures.append(publisher.publish(model))
    store.gate.set()
    for future in futures:
        with pytest.raises(PublishError):
            future.result(timeout=30)
    store.fail_always = False
    with pytest.raises(PublishError):
        publisher.publish(model)
    assert publisher.publish(model).result(timeout=30).version == 2
    publisher.close()
    replica = Replica()
    replica.sync(store)
    assert replica.version == 2 and _equal(replica, model)
