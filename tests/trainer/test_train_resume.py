"""`--resume`: the trainer restarts from its TRL checkpoint (optimizer, scheduler, step and
rollout position) only when that checkpoint's weights are the bucket's last committed version,
bf16 bit for bit; from any other checkpoint it is refused in one line and the bucket is left as
it was, because resuming would publish versions that differ from the ones replicas serve."""

from __future__ import annotations

import subprocess

import pytest
from trainer_cli import ENV, TOKEN, metrics, run_trainer, train_command

from deltasync.store import open_store
from deltasync.wire.manifest import MANIFEST_PATH, read_manifest

pytestmark = pytest.mark.slow


def test_resume_from_the_checkpoint_of_the_last_version_or_refuse(
    tmp_path, tiny_model_dir, start_replica
):
    bucket, run = tmp_path / "bucket", "ckpt"
    out = tmp_path / f"out-{run}"
    with start_replica(tiny_model_dir, bucket, tmp_path / "vllm-0.log", TOKEN) as url:
        first = train_command(tmp_path, tiny_model_dir, [url], steps=2, run_id=run)
        run_trainer([*first, "--save-steps", "1"], tmp_path / "first.log")
        store = open_store(str(bucket))
        committed = read_manifest(store).latest_version
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

        (out / "checkpoint-2").rename(tmp_path / "aside")  # the newest is now a step behind
        before = store.get(MANIFEST_PATH)
        again = train_command(tmp_path, tiny_model_dir, [url], steps=4, run_id=run)
        again += ["--save-steps", "1", "--resume"]
        refused = subprocess.run(again, capture_output=True, text=True, timeout=300, env=ENV)
        assert refused.returncode != 0
        last = refused.stderr.strip().splitlines()[-1]
        assert "checkpoint-1 does not hold version" in last and "would fork the run" in last
        assert store.get(MANIFEST_PATH) == before  # refused before it claimed anything

        (tmp_path / "aside").rename(out / "checkpoint-2")
        log = run_trainer(again, tmp_path / "resumed.log")
    assert f"resuming run {run} at version {committed} from {out / 'checkpoint-2'}" in log
    records = {r["version"]: r for r in metrics(bucket, run)}
    resumed = [records[v] for v in sorted(records) if v > committed]
    assert resumed and resumed[0]["changed_elements"] == 0  # the checkpoint's own weights
    assert [r["step"] for r in resumed][:1] == [2]  # TRL's step, restored from the checkpoint
    assert max(r["step"] for r in resumed) == 4
    for record in resumed:
        assert all(s["ok"] for s in record["replicas"].values()), record
