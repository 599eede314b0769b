"""Followers: rollout servers that follow the bucket themselves (`serve --follow`). The trainer
never syncs them - it only reads the version each serves, for routing - so its work per version
does not grow with them, and a fleet can mix driven replicas and followers.

No vLLM here: a follower is an in-process stand-in that replays the bucket with a real
`deltasync.Replica` on its own thread (every apply verified), and records every call the trainer
makes to it."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from model_steps import AdamWLoop
from test_weight_sync_slow_store import InProcessReplica

from bench.models.qwen3 import tiny_qwen3
from deltasync import Bf16Snapshot, Publisher, PublisherConfig, Replica
from deltasync.errors import DeltaSyncError
from deltasync.store import LocalStore
from trainer.weight_sync import BucketWeightTransfer

STEPS = 6


class InProcessFollower:
    """What the trainer may call on a follower: health and the served version; nothing else."""

    def __init__(self, store: LocalStore):
        self.store, self.replica, self.calls = store, Replica(), Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.replica.sync(self.store)
            except DeltaSyncError:
                continue

    def healthy(self) -> bool:
        self.calls["healthy"] += 1
        return True

    def weight_version(self) -> str:
        self.calls["weight_version"] += 1
        return "default" if self.replica.version is None else str(self.replica.version)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _train(transfer: BucketWeightTransfer) -> object:
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-4)
    transfer.init_weight_transfer()
    transfer.send_weights(iter(model.named_parameters()))  # cold: waits for a follower
    for _ in range(STEPS):
        loop.step()
        transfer.send_weights(iter(model.named_parameters()))
    transfer.destroy()
    return model


def _served_everywhere(followers, model, version: int) -> None:
    expected = Bf16Snapshot.capture(model).tensors
    deadline = time.monotonic() + 60
    while any(f.replica.version != version for f in followers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for follower in followers:
        assert follower.replica.version == version
        for name, tensor in expected.items():
            held = follower.replica.tensors[name]
            assert torch.equal(held.view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("count", [1, 3])
def test_followers_are_never_driven_and_serve_every_version(tmp_path, count):
    store = LocalStore(tmp_path)
    followers = [InProcessFollower(store) for _ in range(count)]
    publisher = Publisher(store, PublisherConfig(run_id="run", write_metrics=False))
    transfer = BucketWeightTransfer(
        publisher,
        {},
        bucket=store.url,
        followers={f"follower-{i}": f for i, f in enumerate(followers)},
        poll_s=0.05,
    )
    started = time.monotonic()
    model = _train(transfer)
    elapsed = time.monotonic() - started
    _served_everywhere(followers, model, STEPS + 1)
    for follower in followers:
        follower.close()
        assert set(follower.calls) == {"healthy", "weight_version"}  # no sync, no init
        # reads are per poll interval, not per version: at most one per 50 ms, plus slack
        assert follower.calls["weight_version"] <= elapsed / 0.05 + 5
    assert [r.version for r in transfer.records] == list(range(1, STEPS + 2))
    for record in transfer.records:  # no trainer-side sync: outcomes seen by polling only
        assert all(o.following and o.ok and o.pause_s == 0 for o in record.replicas)
        assert [o.name for o in record.replicas] == [f"follower-{i}" for i in range(count)]
    assert set(transfer.state.synced) == {f"follower-{i}" for i in range(count)}


def test_a_mixed_fleet_drives_one_and_lets_the_other_follow(tmp_path):
    store = LocalStore(tmp_path)
    driven, follower = InProcessReplica(store), InProcessFollower(store)
    publisher = Publisher(store, PublisherConfig(run_id="run", write_metrics=False))
    transfer = BucketWeightTransfer(
        publisher,
        {"vllm-0": driven},
        bucket=store.url,
        verify_digests=True,
        followers={"follower-0": follower},
        poll_s=0.05,
    )
    model = _train(transfer)
    _served_everywhere([follower], model, STEPS + 1)
    follower.close()
    assert driven.applied == list(range(1, STEPS + 2))  # each version once, verified
    for record in transfer.records:
        assert [(o.name, o.following) for o in record.replicas] == [
            ("vllm-0", False),
            ("follower-0", True),
        ]
    assert set(follower.calls) == {"healthy", "weight_version"}
