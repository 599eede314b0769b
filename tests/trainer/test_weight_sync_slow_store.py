"""The trainer's weight transfer over an artificially slow bucket: optimizer steps go on while an
upload is in flight (measured from the store's own timestamps), and every version is published,
committed and applied exactly once, in order, ending bitwise equal to the trainer's bf16 view.

No vLLM here: the replica is an in-process stand-in for `ReplicaClient` that applies the file the
trainer names with a real `deltasync.Replica`, so a skipped or repeated version fails the chain
check there, and `verify_digests` compares its bytes with the trainer's after every sync.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from model_steps import AdamWLoop

from bench.models.qwen3 import tiny_qwen3
from deltasync import Bf16Snapshot, Publisher, PublisherConfig, Replica
from deltasync.store import LocalStore
from deltasync.wire.digests import tensor_digest
from deltasync.wire.manifest import Manifest
from deltasync.wire.metrics import SyncRecord
from trainer.weight_sync import BucketWeightTransfer

STEPS = 4
_WEIGHT_FILE = re.compile(r"runs/run/(anchors|deltas)/(\d{8})-[0-9a-f]{12}\.safetensors")


class SlowStore(LocalStore):
    """A folder whose weight-file puts take `delay_s` longer; records when each ran."""

    def __init__(self, folder):
        super().__init__(folder)
        self.delay_s = 0.5
        self.uploads: list[tuple[str, float, float]] = []  # (path, start, end), perf_counter
        self.commits: list[int] = []  # latest_version of every manifest written
        self._lock = threading.Lock()

    def put(self, path, data):
        if not _WEIGHT_FILE.fullmatch(path):
            super().put(path, data)
            return
        start = time.perf_counter()
        time.sleep(self.delay_s)
        super().put(path, data)
        with self._lock:
            self.uploads.append((path, start, time.perf_counter()))

    def swap(self, path, data, *, expected):  # the manifest's commit
        super().swap(path, data, expected=expected)
        with self._lock:
            self.commits.append(Manifest.from_json(data).latest_version)


class InProcessReplica:
    """What `BucketWeightTransfer` needs of a `ReplicaClient`, backed by a `deltasync.Replica`
    that applies exactly the file named for each version (as the vLLM backend does)."""

    def __init__(self, store: LocalStore):
        self.store = store
        self.replica = Replica()
        self.applied: list[int] = []

    def healthy(self) -> bool:
        return True

    def init(self, bucket: str) -> None:
        assert bucket == self.store.url

    def sync_to(self, version: int, path: str | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.replica.update(self.store.get(path), path=path):
            self.applied.append(self.replica.version)
        return {"stage_s": time.perf_counter() - t0, "pause_s": 0.0, "staged": True}

    def weight_version(self) -> str:
        return str(self.replica.version)

    def digests(self) -> dict:
        return {"digests": {n: tensor_digest(t) for n, t in self.replica.tensors.items()}}


@pytest.mark.whole_machine  # uploads timed against steps
def test_steps_continue_during_slow_uploads_and_no_version_is_lost(tmp_path):
    store = SlowStore(tmp_path)
    follower = InProcessReplica(store)
    publisher = Publisher(store, PublisherConfig(run_id="run", write_metrics=False))
    transfer = BucketWeightTransfer(
        publisher, {"inproc": follower}, bucket=store.url, verify_digests=True
    )
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-4)
    t0 = time.perf_counter()
    loop.step()  # warm-up: uploads are made slower than a step on this machine, whatever its load
    store.delay_s = max(0.5, 3 * (time.perf_counter() - t0))
    transfer.init_weight_transfer()
    transfer.send_weights(iter(model.named_parameters()))  # TRL's initial sync (waits: cold start)
    steps: list[tuple[float, float]] = []
    handoffs: list[float] = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loop.step()
        t1 = time.perf_counter()
        store.delay_s = max(store.delay_s, 3 * (t1 - t0))  # stay slower than a step under load
        transfer.pause()
        transfer.send_weights(iter(model.named_parameters()))  # live views, as TRL passes them
        transfer.resume()
        steps.append((t0, t1))
        handoffs.append(time.perf_counter() - t1)
    transfer.destroy()  # waits for the syncs still in flight
    records = transfer.records

    # Measured overlap: optimizer steps that began and ended inside one weight-file upload.
    overlapped = [
        (t0, t1) for t0, t1 in steps if any(u0 <= t0 and t1 <= u1 for _, u0, u1 in store.uploads)
    ]
    step_s = [t1 - t0 for t0, t1 in steps]
    upload_s = [u1 - u0 for _, u0, u1 in store.uploads]
    print(
        f"{len(overlapped)}/{STEPS} optimizer steps ran entirely inside an upload; step "
        f"{min(step_s):.3f}-{max(step_s):.3f}s, send_weights {min(handoffs):.3f}-"
        f"{max(handoffs):.3f}s; {len(store.uploads)} uploads of {min(upload_s):.2f}-"
        f"{max(upload_s):.2f}s"
    )
    assert overlapped, (steps, store.uploads)
    assert min(handoffs) < min(upload_s)  # handing a version over does not wait for its upload

    # Every version exactly once: uploaded, committed, recorded, applied, in order.
    versions = list(range(1, STEPS + 2))
    uploaded = [_WEIGHT_FILE.fullmatch(p).groups() for p, _, _ in store.uploads]
    assert sorted(int(v) for kind, v in uploaded if kind == "deltas") == versions[1:]
    assert ("anchors", "00000001") in uploaded
    assert len({p for p, _, _ in store.uploads}) == len(store.uploads)  # no file written twice
    assert store.commits == versions
    assert [r.version for r in records] == versions
    assert all(r.replicas[0].name == "inproc" and r.replicas[0].ok for r in records)  # digests
    assert all(r.replicas[0].attempts == 1 for r in records)
    stored = sorted(tmp_path.glob("runs/run/metrics/*"))
    assert [SyncRecord.from_json(p.read_bytes()) for p in stored] == records  # one writer
    assert follower.applied == versions and transfer.state.synced == {"inproc": versions[-1]}

    # Bitwise: the in-process replica and a cold start from the bucket hold the trainer's bf16.
    expected = Bf16Snapshot.capture(model).tensors
    cold = Replica()
    cold.sync(LocalStore(tmp_path))
    for replica in (follower.replica, cold):
        assert replica.version == versions[-1] and replica.tensors.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))
