"""Background publishing: back-pressure, retries, failures that surface, resume, metrics."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from model_steps import AdamWLoop

from bench.models.qwen3 import tiny_qwen3
from deltasync.codec import encode_anchor
from deltasync.errors import FormatError, PublishError, StoreError
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


def test_a_takeover_removes_uploads_a_killed_publisher_left(tmp_path):
    model = tiny_qwen3()
    with Publisher(LocalStore(tmp_path), _config()) as publisher:
        publisher.publish(model).result(timeout=30)
    deltas = tmp_path / "runs" / "run" / "deltas"
    deltas.mkdir(parents=True, exist_ok=True)
    killed = deltas / ".tmp-killed"
    killed.write_bytes(b"x" * 100)
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    with Publisher(LocalStore(tmp_path), _config(takeover=True)) as restarted:
        restarted.publish(model).result(timeout=30)
    assert not killed.exists()


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


# -- retention, after the version is handed back -------------------------------------------------

RETIRE_EVERY_VERSION = AnchorPolicy(interval=1, max_delta_fraction=None, keep_anchors=1)


def _steps(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` versions of a small model, each a few elements on from the one before."""
    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=generator).to(torch.bfloat16)}
    out = []
    for step in range(count):
        state["w"][step, :3] += 1
        out.append({n: t.clone() for n, t in state.items()})
    return out


class RetentionStore(LocalStore):
    """A folder whose deletes wait for `gate`, then fail when `fail` is set; `deleted` lists
    what it deleted. `before_manifest_read` runs once, before the next read of the manifest."""

    def __init__(self, folder):
        super().__init__(folder)
        self.gate = threading.Event()
        self.fail = False
        self.deleted: list[str] = []
        self.before_manifest_read = None

    def delete(self, path):
        assert self.gate.wait(30)
        if self.fail:
            raise StoreError("injected delete failure", path=path)
        self.deleted.append(path)
        super().delete(path)

    def get(self, path, *, limit=None):
        hook, self.before_manifest_read = self.before_manifest_read, None
        if path == MANIFEST_PATH and hook is not None:
            hook()
        return super().get(path, limit=limit)


def test_retention_deletes_run_after_the_future_resolves(tmp_path):
    """The version's future resolves (a trainer tells its replicas) while retention's deletes
    still wait; they run before the next version's work, and `flush` waits for them."""
    store = RetentionStore(tmp_path)
    states = _steps(3)
    with Publisher(store, _config(policy=RETIRE_EVERY_VERSION)) as publisher:
        first = publisher.publish(states[0]).result(timeout=30)
        record = publisher.publish(states[1]).result(timeout=30)  # deletes are blocked
        assert store.deleted == [] and read_manifest(store).latest_version == 2
        replica = Replica()
        assert replica.sync(store, target=2, path=record.anchor_path) == [2]
        with pytest.raises(TimeoutError):
            publisher.flush(timeout=0.2)
        later = publisher.publish(states[2])
        store.gate.set()
        publisher.flush(timeout=30)
        assert later.result(timeout=0).version == 3
    # version 2 retired version 1's anchor and its own delta (keep_anchors=1), before version 3
    assert store.deleted[:2] == sorted([first.anchor_path, record.delta_path])
    files = {p for p in store.list("runs") if "/metrics/" not in p}
    assert files == read_manifest(store).referenced_paths()


def test_a_failed_retention_delete_is_logged_and_the_version_stays_committed(tmp_path, caplog):
    store = RetentionStore(tmp_path)
    store.gate.set()
    store.fail = True
    publisher = Publisher(store, _config(policy=RETIRE_EVERY_VERSION))
    with caplog.at_level("WARNING", logger="deltasync"), publisher:
        records = [publisher.publish(state).result(timeout=30) for state in _steps(3)]
    assert [r.version for r in records] == [1, 2, 3]
    assert read_manifest(store).latest_version == 3
    warnings = [r.getMessage() for r in caplog.records if "retention could not" in r.getMessage()]
    assert any(records[0].anchor_path in w and "injected" in w for w in warnings)
    assert store.exists(records[0].anchor_path)  # left for gc
    assert Replica().sync(store) == [3]


def test_retention_leaves_the_files_to_an_owner_that_took_the_run_over(tmp_path, caplog):
    """Between a commit and its retention another publisher took the run over: the fenced one
    deletes nothing (the new owner's takeover removed what its manifest does not name)."""
    store = RetentionStore(tmp_path)
    store.gate.set()
    states = _steps(3)
    publisher = Publisher(store, _config(policy=RETIRE_EVERY_VERSION))
    publisher.publish(states[0]).result(timeout=30)
    newer = Publisher(LocalStore(tmp_path), _config(policy=RETIRE_EVERY_VERSION, takeover=True))
    store.before_manifest_read = newer.claim  # retention's check finds the new owner's manifest
    with caplog.at_level("WARNING", logger="deltasync"):
        assert publisher.publish(states[1]).result(timeout=30).version == 2
        publisher.flush(timeout=30)
    assert store.before_manifest_read is None and store.deleted == []
    assert any("another publisher holds" in r.getMessage() for r in caplog.records)
    files = {p for p in store.list("runs") if "/metrics/" not in p}
    assert files == read_manifest(store).referenced_paths()
    with pytest.raises(PublishError):  # fenced at its next commit
        publisher.publish(states[2]).result(timeout=30)
    publisher.close(timeout=30)


def test_an_empty_model_is_neither_published_nor_read(tmp_path):
    """A model with no tensors is a mistake upstream (a state dict not built yet): the
    publisher refuses it before writing anything, and a reader refuses such a file."""
    store = LocalStore(str(tmp_path))
    publisher = Publisher(store, PublisherConfig(run_id="r"))
    with pytest.raises(PublishError, match="no tensors to publish"):
        publisher.publish({})
    publisher.close()
    assert store.list() == []
    empty = encode_anchor({}, run_id="r", version=1)
    replica = Replica()
    with pytest.raises(FormatError, match="names no tensors"):
        replica.update(empty)
    assert replica.version is None
