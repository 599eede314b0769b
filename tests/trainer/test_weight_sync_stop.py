"""When rollouts stop for good (every replica down), the weight transfer's `destroy` - which TRL
calls on the way out - does not wait for replica syncs: vLLM never answers an RPC that was in
flight when its engine died, so waiting would hold the trainer for the request's timeout (CI saw
a trainer outlive its dead replica by 90 s). Versions still publish and commit."""

from __future__ import annotations

import threading

from model_steps import AdamWLoop

from bench.models.qwen3 import tiny_qwen3
from deltasync import Publisher, PublisherConfig
from deltasync.store import LocalStore
from deltasync.wire.manifest import read_manifest
from trainer.weight_sync import BucketWeightTransfer


class HangingReplica:
    """Answers the first sync; every later one blocks until `release` is set (a dead engine)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.syncs = 0

    def healthy(self) -> bool:
        return True

    def init(self, bucket: str) -> None:
        pass

    def sync_to(self, version: int, path: str | None = None) -> dict[str, float]:
        self.syncs += 1
        if self.syncs > 1:
            self.release.wait(120)
        return {"stage_s": 0.0, "pause_s": 0.0, "staged": True}

    def weight_version(self) -> str:
        return "1"


def _destroy_returns(transfer: BucketWeightTransfer) -> bool:
    done = threading.Thread(target=transfer.destroy, daemon=True)
    done.start()
    done.join(30)
    return not done.is_alive()


def _transfer(tmp_path, replica: HangingReplica, stopped: bool) -> BucketWeightTransfer:
    store = LocalStore(tmp_path)
    publisher = Publisher(store, PublisherConfig(run_id="run", write_metrics=False))
    transfer = BucketWeightTransfer(
        publisher, {"vllm-0": replica}, bucket=store.url, stopped=lambda: stopped
    )
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-4)
    transfer.init_weight_transfer()
    transfer.send_weights(iter(model.named_parameters()))  # cold: answered
    for _ in range(2):
        loop.step()
        transfer.send_weights(iter(model.named_parameters()))  # blocks in the replica's sync
    return transfer


def test_destroy_does_not_wait_for_syncs_once_rollouts_stopped(tmp_path):
    replica = HangingReplica()
    transfer = _transfer(tmp_path, replica, stopped=True)
    try:
        assert _destroy_returns(transfer)
        assert read_manifest(LocalStore(tmp_path)).latest_version == 3  # published all the same
    finally:
        replica.release.set()


def test_destroy_waits_for_syncs_while_rollouts_go_on(tmp_path):
    replica = HangingReplica()
    transfer = _transfer(tmp_path, replica, stopped=False)
    waiting = threading.Thread(target=transfer.destroy, daemon=True)
    waiting.start()
    waiting.join(2)
    assert waiting.is_alive()  # the syncs in flight are still waited for
    replica.release.set()
    waiting.join(60)
    assert not waiting.is_alive() and [r.version for r in transfer.records] == [1, 2, 3]
