"""Each version's metrics record carries the step that produced it and that step's reward.

The callbacks run in the order TRL 1.16 and transformers run them (TRL's `StepIntervalCallback`
syncs in `on_step_end`, registered before ours; `log()` comes after `on_step_end`), through
transformers' own `CallbackHandler`; no server, a stand-in replica whose syncs can be slow, and
logs that can come late or not at all.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, TrainerCallback

from deltasync import Publisher, PublisherConfig
from deltasync.store import LocalStore
from deltasync.wire.metrics import SyncRecord
from trainer.rewards import RewardCallback, StepRewards
from trainer.weight_sync import BucketWeightTransfer


class StandInReplica:
    """What the transfer needs of a `ReplicaClient`; `slow` versions take `delay_s` to sync."""

    def __init__(self, slow: set[int] = frozenset(), delay_s: float = 0.0):
        self.version = 0
        self.slow, self.delay_s = slow, delay_s

    def healthy(self) -> bool:
        return True

    def init(self, bucket: str) -> None:
        pass

    def sync_to(self, version: int, path: str | None = None) -> dict[str, float]:
        if version in self.slow:
            time.sleep(self.delay_s)
        self.version = version
        return {"stage_s": 0.01, "pause_s": 0.001}

    def weight_version(self) -> str:
        return str(self.version)


class _SyncEveryStep(TrainerCallback):
    """TRL 1.16's `StepIntervalCallback(self._sync_weight, 1)`: `on_step_end`, pause -> send ->
    resume (kept here as a copy: importing TRL's module loads vLLM)."""

    def __init__(self, sync):
        self.sync = sync

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()


def _reward(step: int) -> float:
    return round(0.1 * step, 3)


def _train(tmp_path, steps: int, *, replica, late_log: dict[int, float], no_log: set[int]):
    """Run the callback sequence of `steps` optimizer steps; returns (records, bucket records)."""
    store = LocalStore(str(tmp_path / "bucket"))
    publisher = Publisher(store, PublisherConfig(run_id="run", write_metrics=False))
    state = TrainerState()
    rewards = StepRewards(step=lambda: state.global_step)
    transfer = BucketWeightTransfer(
        publisher, {"r0": replica}, bucket=store.url, rewards=rewards, reward_wait_s=30.0
    )
    model = torch.nn.Linear(16, 16)

    def sync() -> None:
        transfer.pause()
        transfer.send_weights(iter(model.named_parameters()))
        transfer.resume()

    handler = CallbackHandler(
        [_SyncEveryStep(sync), RewardCallback(rewards)], model, None, None, None
    )
    control = TrainerControl()
    transfer.init_weight_transfer()
    handler.on_train_begin(None, state, control)
    sync()  # TRL's _TrainBeginCallback: the initial sync, version 1, before any step
    for _ in range(steps):
        handler.on_step_begin(None, state, control)
        with torch.no_grad():
            model.weight.add_(0.01)
        state.global_step += 1  # transformers: increment, on_step_end, then log
        handler.on_step_end(None, state, control)
        if state.global_step in no_log:
            continue
        time.sleep(late_log.get(state.global_step, 0.0))
        handler.on_log(None, state, control, logs={"reward": _reward(state.global_step)})
    handler.on_train_end(None, state, control)
    transfer.destroy()
    on_disk = [SyncRecord.from_json(store.get(p)) for p in store.list("runs/run/metrics")]
    return transfer.records, on_disk


def test_each_version_gets_the_reward_of_the_step_that_produced_it(tmp_path):
    # version 3 (step 2) syncs slowly, so steps 3 and 4 log meanwhile (the old code stored
    # whatever was logged last); step 5 logs late (the old code stored step 4's reward).
    replica = StandInReplica(slow={3}, delay_s=0.5)
    records, on_disk = _train(tmp_path, 6, replica=replica, late_log={5: 0.4}, no_log=set())
    assert [r.version for r in records] == list(range(1, 8))
    assert [r.step for r in records] == list(range(7))  # version v holds the weights of step v-1
    assert records[0].reward_mean is None  # the initial weights: no step, no reward
    assert [r.reward_mean for r in records[1:]] == [_reward(s) for s in range(1, 7)]
    assert on_disk == records  # one writer: the transfer's complete record is what is stored
    assert all(r.replicas[0].ok for r in records)


def test_a_step_without_a_logged_reward_gets_none_without_waiting(tmp_path):
    started = time.monotonic()
    _, on_disk = _train(tmp_path, 4, replica=StandInReplica(), late_log={}, no_log={2, 4})
    assert time.monotonic() - started < 20  # not 30 s per unlogged step (reward_wait_s)
    assert [(r.step, r.reward_mean) for r in on_disk] == [
        (0, None),
        (1, _reward(1)),
        (2, None),  # closed when step 3 began
        (3, _reward(3)),
        (4, None),  # closed at train end
    ]


def test_step_rewards_wait_is_bounded_and_first_log_wins():
    rewards = StepRewards()
    t0 = time.monotonic()
    assert rewards.reward(3, timeout=0.2) is None
    assert 0.15 < time.monotonic() - t0 < 5
    rewards.record(3, 0.5)
    rewards.record(3, 0.9)  # e.g. the train-summary log at the last step
    rewards.record(4, float("nan"))
    assert rewards.reward(3, timeout=0) == 0.5 and rewards.reward(4, timeout=0) is None
    assert rewards.reward(None, timeout=10) is None


def test_a_publisher_that_writes_metrics_itself_is_refused(tmp_path):
    publisher = Publisher(LocalStore(str(tmp_path)), PublisherConfig(run_id="run"))
    with pytest.raises(ValueError, match="write_metrics=False"):
        BucketWeightTransfer(publisher, {}, bucket=str(tmp_path))
