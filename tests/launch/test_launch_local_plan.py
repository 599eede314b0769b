"""The local run's plan: ports, tokens, context sizes; and the early checks before anything runs."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from launcher.config import LocalConfig
from launcher.errors import LaunchError
from launcher.local import _check_context, check_ports, local_plan


def test_plan_wires_the_same_bucket_token_and_model_everywhere(tmp_path):
    cfg = LocalConfig(workdir=tmp_path, model_dir=tmp_path / "m", run_name="r", replicas=2)
    plan = local_plan(cfg)
    assert plan.bucket == tmp_path / "r" / "bucket"
    names = [s.name for s in plan.services]
    assert names == ["dashboard", "vllm-0", "vllm-1"]
    for spec in plan.services[1:]:
        assert (
            spec.env["DELTASYNC_API_KEY"] == plan.api_key == plan.trainer.env["DELTASYNC_API_KEY"]
        )
        assert spec.argv[spec.argv.index("--model") + 1] == str(tmp_path / "m")  # served = trained
        assert "--insecure-no-auth" not in spec.argv and spec.ready_line == "ready on "
        assert spec.argv[spec.argv.index("--max-model-len") + 1] == "512"
    argv = plan.trainer.argv
    assert argv[argv.index("--model-dir") + 1] == str(tmp_path / "m")
    assert argv[argv.index("--bucket") + 1] == str(plan.bucket)
    assert plan.prepare is not None


def test_the_dashboard_is_told_the_replicas_for_its_lag_view(tmp_path):
    """As on Spaces (`DELTASYNC_REPLICAS`): it polls each replica's open /health, no token."""
    plan = local_plan(LocalConfig(workdir=tmp_path, replicas=2, vllm_port=9001))
    dashboard = next(s for s in plan.services if s.name == "dashboard")
    urls = "http://127.0.0.1:9001,http://127.0.0.1:9011"
    assert dashboard.env["DELTASYNC_REPLICAS"] == urls
    assert "DELTASYNC_API_KEY" not in dashboard.env
    assert plan.replica_urls == dict(zip(["vllm-0", "vllm-1"], urls.split(","), strict=True))
    argv = plan.trainer.argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--vllm-server-url"] == urls.split(",")


def test_tool_environments_get_a_longer_context_and_real_models_no_prepare(tmp_path):
    plan = local_plan(LocalConfig(workdir=tmp_path, env="wordle"))
    assert plan.services[0].name == "wordle" and plan.services[0].ready_url.endswith("/health")
    replica = plan.services[2].argv
    assert replica[replica.index("--max-model-len") + 1] == "4096"
    real = local_plan(LocalConfig(workdir=tmp_path, model="Qwen/Qwen3-0.6B", env="http://x:1"))
    assert real.prepare is None and [s.name for s in real.services] == ["dashboard", "vllm-0"]
    assert "--model-dir" not in real.trainer.argv
    assert "--env-url" in real.trainer.argv and "http://x:1" in real.trainer.argv


def test_context_check(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(LaunchError, match="context \\(512 tokens\\) is shorter"):
        _check_context(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    _check_context(tmp_path)


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(
            LaunchError, match=f"port {port} on 127.0.0.1 is in use.*--dashboard-port"
        ):
            check_ports(LocalConfig(workdir=Path(tmp_path), dashboard_port=port))
