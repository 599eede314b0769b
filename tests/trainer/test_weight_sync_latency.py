"""Commit-to-serving latency: recorded for every replica at every version, driven and following;
a skipped version counts until the newer one is served and says it was superseded; and a record
still waiting (here for a reward never logged) never holds back the next version's sync.

No vLLM: in-process stand-ins (a real `deltasync.Replica` applying the bucket's files, a follower
replaying the bucket on its own thread, and a replica that only remembers when it was asked)."""

from __future__ import annotations

import threading
import time

import torch
from model_steps import AdamWLoop
from test_weight_sync_followers import InProcessFollower
from test_weight_sync_slow_store import InProcessReplica

from bench.models.qwen3 import tiny_qwen3
from deltasync import Publisher, PublisherConfig
from deltasync.store import LocalStore
from deltasync.wire.metrics import SyncRecord
from trainer.console import version_line
from trainer.rewards import StepRewards
from trainer.weight_sync import BucketWeightTransfer

STEPS = 5


class TimedReplica:
    """Remembers when each sync was asked for; `hold(v)` blocks version v's sync until
    `release()` (the replica is busy, as when it stages a large file)."""

    def __init__(self) -> None:
        self.version = 0
        self.asked: dict[int, float] = {}
        self._held: dict[int, threading.Event] = {}

    def hold(self, version: int) -> threading.Event:
        return self._held.setdefault(version, threading.Event())

    def healthy(self) -> bool:
        return True

    def init(self, bucket: str) -> None:
        pass

    def sync_to(self, version: int, path: str | None = None) -> dict[str, float]:
        self.asked[version] = time.perf_counter()
        if version in self._held:
            self._held[version].wait(30)
        self.version = version
        return {"stage_s": 0.01, "pause_s": 0.002}

    def weight_version(self) -> str:
        return str(self.version)


def _publisher(tmp_path) -> Publisher:
    store = LocalStore(str(tmp_path))
    return Publisher(store, PublisherConfig(run_id="run", write_metrics=False))


def _send(transfer: BucketWeightTransfer, model: torch.nn.Module) -> float:
    started = time.perf_counter()
    transfer.send_weights(iter(model.named_parameters()))
    return started


def _wait_until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_latency_for_every_replica_at_every_version_driven_and_following(tmp_path):
    publisher = _publisher(tmp_path)
    store = publisher.store
    driven, follower = InProcessReplica(store), InProcessFollower(store)
    transfer = BucketWeightTransfer(
        publisher,
        {"vllm-0": driven},
        bucket=store.url,
        followers={"follower-0": follower},
        poll_s=0.05,
    )
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-4)
    transfer.init_weight_transfer()
    began = [_send(transfer, model)]
    for _ in range(STEPS):
        loop.step()
        began.append(_send(transfer, model))
    transfer.destroy()
    ended = time.perf_counter()
    follower.close()

    records = transfer.records
    assert [r.version for r in records] == list(range(1, STEPS + 2))
    for record, start in zip(records, began, strict=True):
        by_name = {o.name: o for o in record.replicas}
        assert set(by_name) == {"vllm-0", "follower-0"}
        assert all(o.ok and o.latency_s is not None for o in by_name.values()), record
        assert all(0 <= o.latency_s <= ended - start for o in by_name.values())
        assert all(o.served_version >= record.version for o in by_name.values())
        assert not by_name["vllm-0"].following and by_name["follower-0"].following
        # a driven replica is seen serving only once its sync answered
        assert by_name["vllm-0"].latency_s >= by_name["vllm-0"].total_s
    stored = [SyncRecord.from_json(store.get(p)) for p in store.list("runs/run/metrics")]
    assert stored == records
    assert "commit-to-serving latency p50 / p95: vllm-0 " in transfer.latency_summary()
    assert "follower-0" in transfer.latency_summary()


def test_a_version_skipped_for_a_newer_one_counts_until_that_one_serves(tmp_path):
    replica = TimedReplica()
    transfer = BucketWeightTransfer(_publisher(tmp_path), {"vllm-0": replica}, bucket="b")
    model = torch.nn.Linear(16, 16)
    transfer.init_weight_transfer()
    _send(transfer, model)  # cold: version 1
    held = replica.hold(2)
    for _ in range(3):  # versions 2, 3, 4: the replica is busy with 2 while 3 and 4 commit
        with torch.no_grad():
            model.weight.add_(0.01)
        _send(transfer, model)
        _wait_until(lambda: 2 in replica.asked)
    _wait_until(lambda: transfer.publisher.committed_version == 4)
    held.set()
    transfer.destroy()

    assert sorted(replica.asked) == [1, 2, 4]  # straight from 2 to the newest: 3 never synced
    v2, v3, v4 = (r.replicas[0] for r in transfer.records[1:])
    assert not v2.superseded(2) and v2.pause_s > 0
    assert v3.superseded(3) and v3.served_version == 4 and v3.pause_s == 0
    assert v4.served_version == 4 and v4.pause_s > 0 and not v4.superseded(4)
    assert v3.latency_s > v4.latency_s  # same moment served, handed over earlier
    line = version_line(transfer.records[2])
    assert f"vllm-0 {v3.latency_s:.2f} s (superseded by v4: nothing applied)" in line
    assert "(paused 0.00 s)" in version_line(transfer.records[3])


def test_a_reward_never_logged_does_not_delay_the_next_versions_sync(tmp_path):
    replica = TimedReplica()
    step = [0]
    rewards = StepRewards(step=lambda: step[0])
    transfer = BucketWeightTransfer(
        _publisher(tmp_path), {"vllm-0": replica}, bucket="b", rewards=rewards, reward_wait_s=20
    )
    model = torch.nn.Linear(16, 16)
    transfer.init_weight_transfer()
    _send(transfer, model)  # cold: version 1 (step 0)
    sent = {}
    for version in (2, 3):  # steps 1 and 2 never log a reward, nor close
        step[0] += 1
        with torch.no_grad():
            model.weight.add_(0.01)
        sent[version] = _send(transfer, model)
        _wait_until(lambda v=version: v in replica.asked)
    try:
        # version 2's record waits up to 20 s for step 1's reward; version 3's sync does not
        assert 3 in replica.asked and replica.asked[3] - sent[3] < 5.0, replica.asked
        assert [r.version for r in transfer.records] == [1]
    finally:
        transfer.destroy()  # training ended: the records stop waiting
    assert [r.version for r in transfer.records] == [1, 2, 3]
    assert [r.reward_mean for r in transfer.records] == [None, None, None]
    latency = transfer.records[2].replicas[0].latency_s
    assert latency is not None and latency < 5.0
