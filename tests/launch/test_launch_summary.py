"""The local run's closing summary, read back from the bucket's typed metrics records."""

from __future__ import annotations

from deltasync.wire.manifest import metrics_path
from deltasync.wire.metrics import ReplicaOutcome, SyncRecord
from launcher.config import LocalConfig
from launcher.local import local_plan, mark_latest, summarize


def _record(version: int, *outcomes: ReplicaOutcome) -> SyncRecord:
    record = SyncRecord(
        run_id="r",
        version=version,
        kind="anchor" if version == 1 else "delta",
        encoding="packed",
        delta_path=None if version == 1 else f"runs/r/deltas/{version:08d}-0123456789ab.x",
        anchor_path=f"runs/r/anchors/{version:08d}-0123456789ab.x" if version == 1 else None,
        delta_bytes=10,
        anchor_bytes=100,
        full_bytes=100,
        changed_elements=5,
        total_elements=50,
        sparsity=0.9,
        diff_s=0.0,
        encode_s=0.0,
        upload_s=0.0,
        queued_s=0.0,
        committed_at=0.0,
    )
    return record.with_sync(outcomes, sync_s=0.1, step=version - 1, reward_mean=None)


def test_summary_counts_versions_each_replica_applied_skipped_or_failed(tmp_path):
    cfg = LocalConfig(workdir=tmp_path, run_name="r")
    plan = local_plan(cfg)
    ok0, ok1 = ReplicaOutcome("vllm-0", True, 1), ReplicaOutcome("vllm-1", True, 1)
    lagging = ReplicaOutcome("vllm-1", False, 2, error="timed out")
    past = ReplicaOutcome("vllm-0", True, 1, served_version=4)  # went straight to v4
    records = (_record(1, ok0, ok1), _record(2, ok0, lagging), _record(3, past, ok1))
    for record in records:
        path = plan.bucket / metrics_path("r", record.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(record.to_json())
    (plan.bucket / metrics_path("r", 4)).write_text('{"version": 4}')  # corrupt: not counted
    lines = summarize(plan, cfg, 90.0, 0)
    assert lines[:3] == [
        "done in 1.5 min: run r, 3 versions published",
        "vllm-0: 2 versions applied and verified, 1 superseded, 0 failed",
        "vllm-1: 2 versions applied and verified, 0 superseded, 1 failed",
    ]
    assert lines[3].startswith(f"bucket:    {plan.bucket}")


def test_latest_names_the_last_runs_folder(tmp_path):
    """README's examples after the quick start use `out/local/latest/bucket`."""
    for run in ("local-1", "local-2"):
        (tmp_path / run / "bucket").mkdir(parents=True)
        mark_latest(tmp_path / run)
    assert (tmp_path / "latest").resolve() == (tmp_path / "local-2").resolve()
    assert (tmp_path / "latest" / "bucket").is_dir()
    mark_latest(tmp_path / "latest")  # a run of that name keeps its folder
    assert (tmp_path / "latest").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "local-1", "local-2"]


def test_the_warm_up_compiles_the_encoding_the_trainer_is_given(tmp_path):
    for trainer_args, encoding in (((), "ctx"), (("--encoding", "ans"), "ans")):
        plan = local_plan(LocalConfig(workdir=tmp_path, trainer_args=trainer_args))
        assert plan.warm_up.argv[-3:] == ("warm-up", "--encoding", encoding)
    plan = local_plan(LocalConfig(workdir=tmp_path, trainer_args=("--encoding=packed",)))
    assert plan.warm_up.argv[-1] == "packed"
