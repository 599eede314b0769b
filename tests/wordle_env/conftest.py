"""Real Wordle servers on loopback for the tests: started as ``python -m wordle_env.server``
(the Space's command) or, where a test says so, as ``uvicorn wordle_env.server.app:app``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from server_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0  # importing openenv (gradio, fastmcp) alone takes ~7 s on two cores
_QUIET = ("--log-level", "warning")
_SETTINGS = {
    "MAX_CONCURRENT_ENVS",
    "ENABLE_WEB_INTERFACE",
    "SESSION_FIRST_MESSAGE_TIMEOUT_S",
    "SESSION_IDLE_TIMEOUT_S",
    "SESSION_LIFETIME_S",
    "SESSION_MAX_STEPS",
    "ENV_API_KEY",
}


@dataclass(frozen=True)
class Server:
    """A running server: its base URL, the file its output goes to, the settings it was given."""

    url: str
    log: Path
    settings: dict[str, str]


def _clean_environ() -> dict[str, str]:
    """The test process's environment without settings that would change the server under test."""
    return {k: v for k, v in os.environ.items() if k not in _SETTINGS}


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if json.load(response).get("status") == "healthy":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def run_server(
    tmp: Path, env: dict[str, str] | None = None, module: str = "wordle_env.server"
) -> Iterator[Server]:
    """Yield a fresh server, ``python -m module``; stop it afterwards and check its log."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    args = ["wordle_env.server.app:app"] if module == "uvicorn" else []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--port", str(port), *_QUIET],
            cwd=REPO_ROOT,
            env={**_clean_environ(), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield Server(url, log, env or {})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="session")
def wordle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with the default settings, shared by the protocol tests."""
    yield from run_server(tmp_path_factory.mktemp("wordle"))


@pytest.fixture(scope="session")
def server_url(wordle_server: Server) -> str:
    return wordle_server.url


@pytest.fixture(scope="session")
def web_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The Space's settings: OpenEnv's web page on, Gradio's temp folder where tests can see it."""
    tmp = tmp_path_factory.mktemp("wordle-web")
    env = {"ENABLE_WEB_INTERFACE": "true", "GRADIO_TEMP_DIR": str(tmp / "gradio")}
    yield from run_server(tmp, env)


@pytest.fixture(scope="session")
def uvicorn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``uvicorn wordle_env.server.app:app``, OpenEnv's way of serving the module-level app."""
    yield from run_server(tmp_path_factory.mktemp("wordle-uvicorn"), module="uvicorn")


@pytest.fixture(scope="module")
def load_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A default-capacity server for the load test alone, so no other test holds a slot."""
    for server in run_server(tmp_path_factory.mktemp("wordle-load")):
        yield server.url


@pytest.fixture(scope="module")
def deadline_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Default capacity (256), deadlines of 6 s and 8 s (not 10 s and 300 s); starvation tests.
    Each connection's clock starts when it is accepted, so filling all 256 slots on a loaded
    machine must take well under the first-message deadline."""
    env = {"SESSION_FIRST_MESSAGE_TIMEOUT_S": "6", "SESSION_IDLE_TIMEOUT_S": "8"}
    yield from run_server(tmp_path_factory.mktemp("wordle-deadlines"), env)


ENV_API_KEY = "test-env-key-0123456789"


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with ``ENV_API_KEY`` set, as ``launch.py`` deploys the Wordle Space."""
    yield from run_server(tmp_path_factory.mktemp("wordle-keyed"), {"ENV_API_KEY": ENV_API_KEY})
