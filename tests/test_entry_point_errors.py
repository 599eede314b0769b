"""User mistakes on launch.py, the trainer and the replica server end in one short error line.

Each case runs the real entry point as a user would and must fail before any server, model or
bucket work: a nonzero exit, an `error:` line naming the problem, no traceback, and nothing
created where the arguments pointed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent-deltasync/dir"

LAUNCH = [sys.executable, str(REPO / "launch.py")]
TRAIN = [sys.executable, "-m", "trainer.train"]
SERVE = [sys.executable, "-m", "deltasync.vllm_ext.serve"]

CASES = {
    "launch: bad steps": ([*LAUNCH, "--local", "--steps", "0"], "--steps"),
    "launch: steps not a number": ([*LAUNCH, "--local", "--steps", "ten"], "--steps"),
    "launch: no replicas": ([*LAUNCH, "--local", "--replicas", "0"], "--replicas"),
    "launch: unknown env": ([*LAUNCH, "--local", "--env", "chess"], "--env"),
    "launch: port out of range": ([*LAUNCH, "--local", "--vllm-port", "70000"], "--vllm-port"),
    "launch: workdir is a file": ([*LAUNCH, "--local", "--workdir", "/etc/hostname"], "workdir"),
    "trainer: bad steps": ([*TRAIN, "--steps", "-3"], "--steps"),
    "trainer: bad learning rate": ([*TRAIN, "--lr", "-1e-4"], "--lr"),
    "trainer: replica URL without a scheme": (
        [*TRAIN, "--vllm-server-url", "localhost:8001"],
        "--vllm-server-url",
    ),
    "trainer: unknown env": ([*TRAIN, "--env", "chess"], "--env"),
    "trainer: batch not a multiple of generations": (
        [*TRAIN, "--batch-size", "6", "--num-generations", "4"],
        "--batch-size",
    ),
    "trainer: model folder missing": ([*TRAIN, "--model", MISSING], "--model"),
    "trainer: unknown bucket scheme": ([*TRAIN, "--bucket", "nosuch://host/b"], "--bucket"),
    "serve: model folder missing": (
        [*SERVE, "--model", MISSING, "--bucket", "/tmp", "--insecure-no-auth"],
        "--model",
    ),
    "serve: port out of range": (
        [*SERVE, "--model", "m", "--port", "0", "--insecure-no-auth"],
        "--port",
    ),
    "serve: unknown bucket scheme": (
        [*SERVE, "--model", "m", "--bucket", "nosuch://host/b", "--insecure-no-auth"],
        "--bucket",
    ),
    "serve: bad startup timeout": (
        [*SERVE, "--model", "m", "--startup-timeout", "-5", "--insecure-no-auth"],
        "--startup-timeout",
    ),
}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DELTASYNC_API_KEY"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every case at once (each pays a Python start-up; two at a time on 2 cores)."""
    dirs = {name: tmp_path_factory.mktemp("cwd") for name in CASES}
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda name: _run(CASES[name][0], dirs[name]), CASES)
        return {name: (result, dirs[name]) for name, result in zip(CASES, done, strict=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_is_one_line_and_changes_nothing(results, case):
    result, cwd = results[case]
    _, mentions = CASES[case]
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors, output
    assert mentions in errors[-1], output
    assert len(errors[-1]) < 300, errors[-1]
    assert list(cwd.iterdir()) == [], f"{case} created {list(cwd.iterdir())}"
