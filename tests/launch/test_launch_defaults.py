"""`launch.py`, the launcher and the trainer read their shared defaults from `trainer/defaults.py`,
and the launcher side stays free of torch and TRL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launch import build_parser
from launcher.config import LocalConfig, SpacesConfig
from trainer import defaults

REPO = Path(__file__).resolve().parents[2]


def test_launcher_imports_without_torch_or_trl():
    code = (
        "import sys\n"
        "for name in ('torch', 'trl', 'transformers', 'numba'):\n"
        "    sys.modules[name] = None  # importing them now raises ImportError\n"
        "import launch, launcher.local, launcher.remote, launcher.spaces, trainer.defaults\n"
        "launch.build_parser().parse_args(['--local'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_local_run_and_trainer_alone_share_their_defaults():
    from trainer.train import build_parser as trainer_parser

    trainer = trainer_parser().parse_args([])
    local = LocalConfig()
    assert trainer.steps == local.steps == defaults.STEPS
    assert trainer.model == local.model == defaults.MODEL
    assert Path(trainer.model_dir) == local.model_dir
    assert trainer.env == local.env == defaults.ENV
    assert trainer.env_url.endswith(f":{local.env_port}")
    assert defaults.VLLM_URL.endswith(f":{local.vllm_port}")


def test_launch_parser_uses_the_config_defaults():
    args = build_parser().parse_args(["--local"])
    local = LocalConfig()
    assert (args.vllm_port, args.env_port, args.dashboard_port) == (
        local.vllm_port,
        local.env_port,
        local.dashboard_port,
    )
    assert args.model_dir == local.model_dir
    assert SpacesConfig(model="m").steps == defaults.SPACES_STEPS
