"""A `deltasync.vllm_ext.serve` process on a free loopback port, always stopped afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from deltasync import settings
from deltasync.vllm_ext.client import ReplicaClient

__all__ = ["free_port", "served", "wait_ready"]

START_TIMEOUT_S = 900.0
READY_LINE = "ready on"  # what `deltasync.vllm_ext.serve` logs once it answers
POLL_S = 0.2  # a log file read costs nothing beside a vLLM start


def wait_ready(log: Path, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once the server logged that it is ready; raise with the log's tail if it exited
    or `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server not ready:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(POLL_S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(
    model_dir: Path,
    bucket: Path,
    log: Path,
    *,
    token: str | None = None,
    vllm_args: tuple[str, ...] = (),
    port: int | None = None,
    dev_routes: bool = False,
    serve_args: tuple[str, ...] = (),
) -> Iterator[tuple[ReplicaClient, psutil.Process]]:
    """Start a replica that bootstraps from `bucket`; yields its client and process once ready.

    `dev_routes`: also let this (loopback) client reach vLLM's dev routes (/pause, any
    `/collective_rpc` method, ...), which a benchmark's baseline needs; weights still change
    only through the sync route otherwise. `serve_args`: more launcher flags (before `--`)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "deltasync.vllm_ext.serve", "--model", str(model_dir)]
    cmd += ["--bucket", str(bucket), "--port", str(port)]
    cmd += [] if token else ["--insecure-no-auth"]
    cmd += ["--dev-routes"] if dev_routes else []
    cmd += list(serve_args)
    cmd += ["--", "--max-model-len", "512", "--max-num-seqs", "4", "--disable-log-stats"]
    cmd += list(vllm_args)
    env = {**os.environ, settings.API_KEY.name: token or ""}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_ready(log, proc)
        client = ReplicaClient(f"http://127.0.0.1:{port}", token, timeout_s=1800)
        yield client, psutil.Process(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
