"""Real servers a test starts: a free loopback port for one, and stopping it (its launcher
first, then whatever is left)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable

import psutil


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_server(proc: subprocess.Popen, children: list[int]) -> None:
    """SIGTERM the launcher (it stops vLLM's group), then kill the rest, by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def still_running(processes: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes` still running after waiting up to `timeout_s` for them to end. A
    zombie counts as ended: a killed process whose parent died too waits for PID 1 to reap it,
    which in a container may be never."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [p for p in processes if _running(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
