"""The end-of-run environment report: from the dicts TRL logs per step it tells a run that never
got a successful tool call or a changing reward, and `launch.py` reads its warnings back."""

from __future__ import annotations

import json
import queue
from types import SimpleNamespace

from trainer.envs.report import FILE, EnvReport, RolloutTap, load_warnings


def _report(*logs: dict, tools: tuple[str, ...] = ("add", "shout")) -> EnvReport:
    report = EnvReport("run", "http://x", "the server's `reward`", tools)
    for entry in logs:
        report.observe(entry)
    return report


def _step(reward: float, std: float = 0.0, **tools: float) -> dict:
    return {"loss": 0.1, "reward": reward, "reward_std": std, **tools}


def test_a_learning_run_has_no_warning():
    report = _step(0.5, 0.5, **{"tools/add/call_total": 4, "tools/add/failure_total": 1})
    assert _report(report, _step(1.0)).warnings() == []


def test_no_tool_call():
    (warning,) = _report(_step(0.0), _step(0.0, 0.1)).warnings()
    assert warning.startswith("no tool call in 2 steps: the model never called add, shout")


def test_every_tool_call_failed():
    counters = {
        "tools/add/call_total": 3,
        "tools/add/failure_total": 3,
        "tools/unknown_name_total": 2,  # counted again under the name: not a second failure
        "tools/nope/call_total": 2,
        "tools/nope/failure_total": 2,
    }
    (warning,) = _report(_step(0.0, 0.2, **counters)).warnings()
    assert warning.startswith("none of the 5 tool calls succeeded")


def test_a_reward_that_never_changes():
    calls = {"tools/add/call_total": 1}
    (warning,) = _report(_step(0.0, **calls), _step(0.0), {"loss": 1.0}).warnings()
    assert warning.startswith("the reward never changed (always 0 over 2 steps; source: the")
    assert _report(_step(0.0, **calls), _step(0.5)).warnings() == []  # changed between steps
    assert _report(_step(0.0, 0.3, **calls), _step(0.0)).warnings() == []  # within a step


def test_tool_calls_kept_as_context_are_named():
    """A turn TRL re-renders otherwise than the model wrote it (Qwen3's think block) is kept as
    untrained context: with most turns realigned, GRPO never trains a call."""
    calls = {"tools/add/call_total": 4}
    realigned = [_step(0.5, 0.5, **calls, **{"rollout/realign_frac": 1.0}) for _ in range(3)]
    (warning,) = _report(*realigned).warnings()
    assert warning.startswith("100% of the turns before a tool's reply were re-rendered")
    clean = [_step(0.5, 0.5, **calls, **{"rollout/realign_frac": f}) for f in (0.0, 0.1, 0.0)]
    assert _report(*clean).warnings() == []


def test_a_class_without_tools_gets_no_tool_warning():
    assert _report(_step(1.0), _step(0.0), tools=()).warnings() == []


def test_values_that_are_no_numbers_are_ignored():
    report = _report({"reward": "nan", "tools/add/call_total": None}, _step(float("inf")))
    assert report.rewards == [] and report.calls == 0


def test_saved_for_the_launcher_of_that_run_only(tmp_path):
    report = _report(_step(0.0), _step(0.0))
    path = report.save(tmp_path / "trainer")
    assert path.name == FILE and json.loads(path.read_text())["tool_calls"] == 0
    assert load_warnings(tmp_path / "trainer", "run") == report.warnings() != []
    assert load_warnings(tmp_path / "trainer", "another-run") == []
    assert load_warnings(tmp_path / "nowhere", "run") == []
    path.write_text("{not json")
    assert load_warnings(tmp_path / "trainer", "run") == []


def _learning_step(reward: float, calls: float, failed: float = 0.0) -> dict:
    frequencies = {"tools/call_frequency": calls, "tools/failure_frequency": failed}
    return {**_step(reward, 0.1), **frequencies}


def test_thirds_of_the_run_and_their_line():
    steps = [_learning_step(0.1 * i, 0.5 + 0.1 * i, 0.5 if i < 2 else 0.0) for i in range(6)]
    report = _report(*steps)
    thirds = report.thirds()
    assert [round(v, 3) for v in thirds["reward"]] == [0.05, 0.25, 0.45]
    # a rollout's valid calls: its calls (at most one counts) less the failed share of them
    assert [round(v, 3) for v in thirds["valid_calls"]] == [0.275, 0.75, 0.95]
    assert report.summary() == (
        "by thirds of the run: rollouts with a valid tool call 28% / 75% / 95%; "
        "mean reward 0.050 / 0.250 / 0.450"
    )


def test_no_thirds_under_three_steps_and_no_call_share_without_tools():
    assert _report(_learning_step(0.1, 1.0), _learning_step(0.2, 1.0)).summary() is None
    report = _report(*(_step(0.1 * i, 0.1) for i in range(3)), tools=())
    assert report.summary() == "by thirds of the run: mean reward 0.000 / 0.100 / 0.200"


def test_thirds_follow_the_order_the_groups_started():
    """A group whose task takes more turns reaches the trainer later: rows taken out of order
    still count in the third their group started in (TRL's `group_id`, the dataset's order), and
    groups after one never taken (still running when training ended) do not count."""
    report = _report(*(_learning_step(0.9, 1.0) for _ in range(6)))  # the steps' order: ignored
    for group in (1, 0, 3, 2, 5, 4, 7):  # group 6 is still running when training ends
        for reward in (0.1 * group - 0.05, 0.1 * group + 0.05):  # two rows, mean 0.1 * group
            # no tool call in groups 0 and 1 (TRL then sends no call metrics), one in the rest
            calls = {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0}
            report.observe_row(group, {"reward": reward, **(calls if group > 1 else {})})
    thirds = report.thirds()
    assert [round(v, 3) for v in thirds["reward"]] == [0.05, 0.25, 0.45]
    assert thirds["valid_calls"] == [0.0, 1.0, 1.0]
    assert [round(v, 3) for v in report.group_rewards()] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]


def test_the_tap_shows_the_trainer_s_rows_until_training_ends():
    rows = queue.Queue()
    for group, reward in ((2, 0.5), (0, 0.0), (1, 1.0), (3, 0.25)):
        rows.put(SimpleNamespace(group_id=group, metrics={"reward": reward}))
    report = _report()
    tap = RolloutTap(rows, report)
    taken = [tap.get(timeout=1).group_id for _ in range(3)]
    assert taken == [2, 0, 1] and tap.qsize() == 1  # samples pass through; the rest is the queue's
    tap.stop()
    tap.get(timeout=1)  # drained after training: not a rollout the run trained on
    assert report.group_rewards() == [0.0, 1.0, 0.5]
