"""Every environment session a rollout opens is closed when the rollout ends, however it ends
(done, out of tool calls, no tool call, a failing tool, cut off by the worker's end), so the
environment server logs no traceback: a user's server showed 142 after a 10-step run.

The servers are OpenEnv's bare `create_app` (as users build theirs) in a subprocess whose log is
read; the rollouts run in another subprocess through the trainer's own session code
(`session_rollouts.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
START_TIMEOUT_S = 120.0

pytestmark = pytest.mark.slow


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.2)


@pytest.fixture(params=["mcp", "say"])
def server(request, tmp_path) -> Iterator[tuple[str, str, Path]]:
    """(kind, URL, log) of a bare OpenEnv server of that kind, stopped after the test."""
    kind, port, log = request.param, free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "uvicorn", f"session_rollouts:bare_{kind}_app", "--factory"]
    cmd += ["--app-dir", str(HERE), "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        yield kind, f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(30)


def test_rollouts_close_their_sessions_however_they_end(server):
    kind, url, log = server
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    played = subprocess.run(
        [sys.executable, str(HERE / "session_rollouts.py"), kind, url],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    time.sleep(1.0)  # the server handles the last disconnects
    text = log.read_text(errors="replace")
    assert "the rollout worker failed with rollouts in flight" in played.stderr, played.stderr
    report = json.loads(played.stdout.strip().splitlines()[-1])
    assert report["left_open"] == [], "sessions still open after their rollout ended"
    assert text.count("connection open") >= 10, text  # pre-flight, rollouts and the cut-off ones
    tracebacks = text.count("Traceback"), text.count("Exception in ASGI application")
    assert tracebacks == (0, 0), text[-4000:]
