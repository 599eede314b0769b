"""Stopping a real rollout server a test started: its launcher first, then whatever is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
