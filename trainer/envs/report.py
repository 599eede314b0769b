"""What an environment run taught, from TRL's per-step logs and the rollouts the trainer took:
did any tool call succeed, did the reward ever change, how both went by thirds of the run. A run
where neither happened learned nothing, and says so at its end (the trainer's log and
`launch.py`'s summary, which reads `env_report.json` in the trainer's output folder). Stdlib
only: the launcher reads it without torch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["FILE", "EnvReport", "RolloutTap", "load_warnings"]

FILE = "env_report.json"
_COUNTER = re.compile(r"tools/.+/(call|failure)_total")  # TRL sums them per logged step


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _thirds(values: list[float]) -> list[float] | None:
    """The means of a run's first, middle and last third of steps (None under 3 steps)."""
    if len(values) < 3:
        return None
    bounds = [round(len(values) * i / 3) for i in range(4)]
    return [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(bounds)]


def _valid_call(metrics: dict[str, Any]) -> float | None:
    """A rollout's (or a step's mean) valid tool calls: TRL's `tools/call_frequency` (calls)
    times one minus `tools/failure_frequency` (the share of them that failed), exact while a
    rollout makes at most one call, as the format warm-up teaches."""
    calls = _number(metrics.get("tools/call_frequency"))
    if calls is None:
        return None
    return min(1.0, calls) * (1.0 - (_number(metrics.get("tools/failure_frequency")) or 0.0))


class EnvReport:
    """Tool calls and rewards of a run, fed with every dict TRL logs (`observe`) and, where the
    trainer taps TRL's rollout queue (`RolloutTap`), with every rollout it takes (`observe_row`).

    `thirds` sums rewards and valid tool calls up by thirds of the run: of its rollout groups in
    the order they were started (TRL's `group_id`, the dataset's order) when rows were observed,
    else of its optimizer steps. The order started is the fair one: a group whose task takes more
    turns reaches the trainer later, so in training order the thirds hold the tasks unevenly."""

    def __init__(self, run_id: str, env: str, reward: str, tools: tuple[str, ...]):
        self.run_id, self.env, self.reward, self.tools = run_id, env, reward, tools
        self.calls = self.failures = 0
        self.rewards: list[float] = []
        self.valid_calls: list[float] = []  # per step: successful tool calls per rollout
        self.spread = False  # some logged step had rewards that differed
        self.realigned: list[float] = []  # per step: share of turn transitions TRL realigned
        self.groups: dict[int, list[tuple[float, float | None]]] = {}  # (reward, valid call)

    def observe(self, logs: dict[str, Any]) -> None:
        for key, value in logs.items():
            match = _COUNTER.fullmatch(key)
            if match and (count := _number(value)) is not None:
                if match[1] == "call":
                    self.calls += int(count)
                else:
                    self.failures += int(count)
        realigned = _number(logs.get("rollout/realign_frac"))
        if realigned is not None:
            self.realigned.append(realigned)
        reward = _number(logs.get("reward"))
        if reward is not None:
            self.rewards.append(reward)
            self.spread = self.spread or (_number(logs.get("reward_std")) or 0.0) > 0.0
            if (valid := _valid_call(logs)) is not None:
                self.valid_calls.append(valid)

    def observe_row(self, group_id: int, metrics: dict[str, Any]) -> None:
        """One training row of a rollout (TRL's `RolloutSample`), stale or not."""
        reward = _number(metrics.get("reward"))
        if reward is not None:
            valid = _valid_call(metrics)  # TRL leaves it out of a group that called no tool
            if valid is None and self.tools:
                valid = 0.0
            self.groups.setdefault(group_id, []).append((reward, valid))

    def _started(self) -> list[list[tuple[float, float | None]]]:
        """The observed groups in the order they were started, up to the first never taken: the
        trainer stops while slower groups started before faster ones are still running, and
        counting only the fast ones would favour the tasks that finish first."""
        ordered = []
        for expected, group_id in enumerate(sorted(self.groups)):
            if group_id != expected:
                break
            ordered.append(self.groups[group_id])
        return ordered

    def group_rewards(self) -> list[float]:
        """The mean reward of each rollout group, in the order started (see `_started`)."""
        return [sum(r for r, _ in g) / len(g) for g in self._started()]

    def thirds(self) -> dict[str, list[float]]:
        """Mean reward and valid tool calls per rollout by thirds of the run: of its groups in
        the order started when rows were observed, else of its steps."""
        if len(rows := self._started()) >= 3:
            rewards = [sum(r for r, _ in group) / len(group) for group in rows]
            valid = [[v for _, v in group if v is not None] for group in rows]
            calls = [sum(v) / len(v) for v in valid] if all(valid) else []  # None: no tools
        else:
            rewards, calls = self.rewards, self.valid_calls
        found = {"reward": _thirds(rewards), "valid_calls": _thirds(calls)}
        return {k: v for k, v in found.items() if v is not None}

    def summary(self) -> str | None:
        """One line for the end of the run (None when it ran under 3 steps)."""
        thirds = self.thirds()
        parts = []
        if self.tools and "valid_calls" in thirds:
            shares = " / ".join(f"{v:.0%}" for v in thirds["valid_calls"])
            parts.append(f"rollouts with a valid tool call {shares}")
        if "reward" in thirds:
            parts.append(f"mean reward {' / '.join(f'{v:.3f}' for v in thirds['reward'])}")
        return f"by thirds of the run: {'; '.join(parts)}" if parts else None

    def warnings(self) -> list[str]:
        """One line per reason this run could not learn from its environment."""
        found = []
        steps = len(self.rewards)
        span = f"{steps} step{'' if steps == 1 else 's'}"
        if self.tools and self.calls == 0:
            found.append(
                f"no tool call in {span}: the model never called {', '.join(self.tools)}, so "
                "the environment never acted"
            )
        elif self.tools and self.failures >= self.calls:
            found.append(
                f"none of the {self.calls} tool calls succeeded (unknown tool, wrong arguments "
                "or a server error: see tools/* in the trainer log)"
            )
        if steps and not self.spread and len(set(self.rewards)) == 1:
            found.append(
                f"the reward never changed (always {self.rewards[0]:g} over {span}; source: "
                f"{self.reward}): GRPO had nothing to learn from (echo-style servers send none)"
            )
        if self.realigned and (share := sum(self.realigned) / len(self.realigned)) > 0.1:
            found.append(
                f"{share:.0%} of the turns before a tool's reply were re-rendered otherwise than "
                "the model wrote them (rollout/realign_frac): TRL keeps such a turn as context, "
                "so its tool call is never trained; render the generation prompt as the chat "
                "template renders earlier turns (trainer.config.BUILT_CHAT)"
            )
        return found

    def save(self, folder: str | Path) -> Path:
        """Write the report (atomically) for `launch.py`'s summary; returns its path."""
        path = Path(folder) / FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "run_id": self.run_id,
            "env": self.env,
            "reward": self.reward,
            "tools": list(self.tools),
            "tool_calls": self.calls,
            "tool_failures": self.failures,
            "rewards": self.rewards,
            "group_rewards": self.group_rewards(),
            "valid_calls": self.valid_calls,
            "thirds": self.thirds(),
            "summary": self.summary(),
            "warnings": self.warnings(),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
        return path


class RolloutTap:
    """TRL's rollout queue (`AsyncGRPOTrainer.rollout_queue`) that shows every sample the
    trainer takes from it to `report.observe_row` first; everything else goes to the queue."""

    def __init__(self, rollout_queue: Any, report: EnvReport):
        self._queue, self._report = rollout_queue, report

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self._queue.get(*args, **kwargs)
        if self._report is not None:
            self._report.observe_row(int(sample.group_id), sample.metrics)
        return sample

    def stop(self) -> None:
        """Training is over: what is drained from the queue now was never trained on."""
        self._report = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def load_warnings(folder: str | Path, run_id: str) -> list[str]:
    """The warnings run `run_id` left in `folder` (none without a readable report of it)."""
    try:
        record = json.loads((Path(folder) / FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return []
    warnings = record.get("warnings")
    return [str(w) for w in warnings] if isinstance(warnings, list) else []
