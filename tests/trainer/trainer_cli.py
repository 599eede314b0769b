"""Helpers for tests that run `python -m trainer.train` as a subprocess (`from trainer_cli import
...` in this folder's test modules) and read the metrics records it leaves in the bucket."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

TOKEN = f"test-{secrets.token_hex(16)}"
ENV = dict(os.environ, DELTASYNC_API_KEY=TOKEN, TRL_EXPERIMENTAL_SILENCE="1")  # the trainer's
T = TypeVar("T")


def train_command(
    tmp: Path,
    model: Path,
    urls: list[str],
    *,
    steps: int,
    run_id: str,
    extra: tuple = (),
    preset: str = "tiny",
) -> list[str]:
    """The trainer on a built model (`preset`, already built in `model`), verifying replicas
    every sync; `--verbose`, so its raw log lines reach the test's log too."""
    cmd = [sys.executable, "-m", "trainer.train", "--model", preset, "--model-dir", str(model)]
    cmd += ["--bucket", str(tmp / "bucket"), "--run-id", run_id, "--steps", str(steps)]
    cmd += ["--output-dir", str(tmp / f"out-{run_id}"), "--verify-replicas", "--verbose"]
    cmd += list(map(str, extra))
    for url in urls:
        cmd += ["--vllm-server-url", url]
    return cmd


@contextlib.contextmanager
def trainer_process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """The trainer in a process group of its own (with its rollout child); killed if still
    running when the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def run_trainer(cmd: list[str], log: Path, timeout_s: float = 900) -> str:
    """Run to the end; returns the log after checking the exit status is 0."""
    with trainer_process(cmd, log) as proc:
        proc.wait(timeout_s)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    return text


def metrics(bucket: Path, run_id: str) -> list[dict]:
    """The run's metrics records by version (written atomically, so never half a file)."""
    paths = sorted((bucket / "runs" / run_id / "metrics").glob("*.json"))
    return [json.loads(p.read_text()) for p in paths]


def wait_until(
    what: str,
    probe: Callable[[], T | None],
    proc: subprocess.Popen,
    log: Path,
    timeout_s: float,
    poll_s: float = 1.0,
) -> T:
    """Poll `probe` every `poll_s` until it returns something truthy; fail if the trainer exits
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(
                f"trainer exited ({proc.returncode}) before {what}:\n"
                + log.read_text(errors="replace")[-5000:]
            )
        time.sleep(poll_s)
    raise AssertionError(f"no {what} after {timeout_s:.0f}s:\n" + log.read_text()[-5000:])
