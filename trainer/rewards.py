"""The reward TRL logs per optimizer step, for the metrics record of the version that step made.

Order per optimizer step N in transformers' loop (TRL 1.16 `AsyncGRPOTrainer`): `global_step`
becomes N, `on_step_end` callbacks run in registration order - TRL's own weight-sync callback
first, so `send_weights` gets the weights after step N (version N + 1; version 1 is the initial
sync at train begin, step 0) - and only then `log()` runs, whose `reward` is the mean reward of
the samples trained in step N. So the reward of a version's step arrives just *after* its
`send_weights`: the weight transfer tags each version with `global_step` when `send_weights` is
called and its sync thread waits (bounded) for that step's reward here.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from transformers import Trainer, TrainerCallback

__all__ = ["RewardCallback", "StepRewards"]


class StepRewards:
    """Rewards by optimizer step, filled by `RewardCallback`, read by the weight transfer.

    A step is *closed* once the trainer is past its logging point (a later log, the next step's
    start, or the end of training): waiting for a closed step's reward returns at once.

    Args:
        step: the trainer's current `global_step` (read when `send_weights` is called).
        keep: rewards remembered (the newest steps).
    """

    def __init__(self, step: Callable[[], int] = lambda: 0, keep: int = 4096):
        self._step = step
        self._keep = keep
        self._rewards: dict[int, float | None] = {}
        self._closed = -1  # every step <= this one has been logged, or never will be
        self._ended = False
        self._cond = threading.Condition()

    def current_step(self) -> int:
        return int(self._step())

    def track(self, trainer: Trainer) -> None:
        """Read the current step from `trainer` (its state object is replaced when training
        starts, so it is read through the trainer at each call)."""
        self._step = lambda: trainer.state.global_step

    def record(self, step: int, reward: float | None) -> None:
        """TRL logged `reward` at `step` (the first log of a step wins; NaN becomes None)."""
        if reward is not None and not math.isfinite(reward):
            reward = None
        with self._cond:
            self._rewards.setdefault(step, reward)
            for old in sorted(self._rewards)[: max(0, len(self._rewards) - self._keep)]:
                del self._rewards[old]
            self._closed = max(self._closed, step)
            self._cond.notify_all()

    def close_through(self, step: int) -> None:
        """Nothing more will be logged for `step` or any step before it."""
        with self._cond:
            self._closed = max(self._closed, step)
            self._cond.notify_all()

    def end(self) -> None:
        """Training ended: waiters return what they have."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def reward(self, step: int | None, timeout: float) -> float | None:
        """The reward logged at `step`, waiting up to `timeout` s until the step is closed."""
        if step is None:
            return None
        deadline = time.monotonic() + timeout
        with self._cond:
            while step > self._closed and not self._ended and step not in self._rewards:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._rewards.get(step)


class RewardCallback(TrainerCallback):
    """Records TRL's logged `reward` under the `global_step` it was logged at."""

    def __init__(self, rewards: StepRewards):
        self.rewards = rewards

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            value = logs["reward"]
            self.rewards.record(state.global_step, None if value is None else float(value))
        else:
            self.rewards.close_through(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        # Step global_step + 1 begins: step global_step's log, if any, has happened.
        self.rewards.close_through(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.rewards.end()
