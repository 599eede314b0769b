"""What the launcher and the trainer print about themselves is true: commands name the
interpreter that runs launch.py, and the help texts name the real defaults and keep their lines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import launch
from launcher import commands
from launcher.commands import interpreter, shown, verify_command
from launcher.config import LocalConfig
from launcher.local import local_plan, summarize
from trainer import defaults


def test_commands_name_this_interpreter_relative_to_the_current_folder(monkeypatch):
    root = Path(sys.executable).parents[2]  # /repo for /repo/.venv/bin/python
    monkeypatch.chdir(root)
    assert interpreter() == os.path.relpath(sys.executable, root)
    assert shown(verify_command("./b")) == f"{interpreter()} -m deltasync verify ./b"


def test_a_venv_under_the_current_folder_is_shown_as_typed(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(commands, "PY", str(tmp_path / ".venv" / "bin" / "python"))
    assert shown([commands.PY, "-m", "x"]) == ".venv/bin/python -m x"
    monkeypatch.setattr(commands, "PY", str(tmp_path / "python"))
    assert interpreter() == "./python"  # `python` alone would be PATH's


def test_an_interpreter_elsewhere_is_shown_in_full(monkeypatch, tmp_path):
    monkeypatch.setattr(commands, "PY", "/opt/py/bin/python3")
    monkeypatch.chdir(tmp_path)
    assert shown(["/opt/py/bin/python3", "-m", "x"]) == "/opt/py/bin/python3 -m x"


def test_the_summary_command_is_run_by_this_interpreter(tmp_path):
    cfg = LocalConfig(workdir=tmp_path, run_name="r")
    lines = summarize(local_plan(cfg), cfg, 60.0, 0)
    view = next(line for line in lines if line.startswith("dashboard:"))
    assert f"view it again with: {interpreter()} -m spaces.dashboard.app --bucket" in view


def test_launch_help_names_the_default_local_model():
    text = launch.build_parser().format_help()
    assert "tiny model" not in text
    assert f"the `{defaults.MODEL}` random Qwen3" in text
    assert f"--local: {defaults.MODEL!r} (default)" in " ".join(text.split())


def test_trainer_help_keeps_the_lines_of_its_examples():
    from trainer.train import __doc__ as doc
    from trainer.train import build_parser

    text = build_parser().format_help()
    example = [line for line in doc.splitlines() if line.startswith("    python -m")][1]
    assert example.endswith("\\") and f"\n{example}\n" in text
    assert "\n        --bucket hf://buckets/me/rl" in text
