"""The trainer process killed mid-run (SIGKILL of its process group, no shutdown code) and started
again with the same `--run-id`: refused in one line without `--takeover`; with it, it resumes
the run from the bucket's manifest, so versions continue right after the last committed one
(none skipped, none published twice), and the replica that kept serving follows the new versions
and is verified bitwise after each."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from trainer_cli import ENV, TOKEN, metrics, run_trainer, train_command, trainer_process, wait_until

from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.wire.manifest import read_manifest

pytestmark = pytest.mark.slow


def _committed(bucket) -> int:
    manifest = read_manifest(open_store(str(bucket)))
    return 0 if manifest is None else manifest.latest_version


def test_trainer_killed_and_restarted_resumes_the_run(tmp_path, tiny_model_dir, start_replica):
    bucket, run = tmp_path / "bucket", "resume"
    with start_replica(tiny_model_dir, bucket, tmp_path / "vllm-0.log", TOKEN) as url:
        first = train_command(tmp_path, tiny_model_dir, [url], steps=20, run_id=run)
        with trainer_process(first, tmp_path / "first.log") as trainer:
            wait_until(  # the manifest, not the metrics records (they wait for rewards)
                "3 versions committed",
                lambda: _committed(bucket) >= 3,
                trainer,
                tmp_path / "first.log",
                timeout_s=600,
            )
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
        committed = read_manifest(open_store(str(bucket))).latest_version
        assert 3 <= committed < 21  # killed mid-run
        second = train_command(tmp_path, tiny_model_dir, [url], steps=2, run_id=run)
        refused = subprocess.run(second, capture_output=True, text=True, timeout=300, env=ENV)
        assert refused.returncode != 0  # the run is in the bucket: only --takeover continues it
        assert "pass --takeover to continue it" in refused.stderr.strip().splitlines()[-1]
        assert read_manifest(open_store(str(bucket))).latest_version == committed
        second += ["--takeover"]
        log = run_trainer(second, tmp_path / "second.log")
    assert f"resuming run {run} at version {committed}" in log
    resumed = [r for r in metrics(bucket, run) if r["version"] > committed]
    # The restarted trainer's initial sync and its 2 steps, each once, right after `committed`.
    assert [r["version"] for r in resumed] == [committed + 1, committed + 2, committed + 3]
    assert resumed[0]["changed_elements"] == 0  # it trains on from the bucket's weights
    for record in resumed:
        assert all(s["ok"] for s in record["replicas"].values()), record
    store = open_store(str(bucket))
    manifest = read_manifest(store)
    assert (manifest.run_id, manifest.latest_version) == (run, committed + 3)
    cold = Replica()
    assert cold.sync(store)[-1] == committed + 3  # a cold start replays across the restart
