"""FSDP2 ranks publish their own shards (`torchrun --nproc_per_node 2`, gloo, `fully_shard`):
every version replays bitwise from the bucket; a rank killed mid-upload commits nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fsdp_runs import torchrun

from deltasync.codec import ParsedFile
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.manifest import read_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def assert_replays_bitwise(bucket: Path, expected: Path, versions: range) -> None:
    """A fresh replica at every version holds exactly the ranks' gathered bf16 weights."""
    store = LocalStore(str(bucket))
    replica = Replica()
    for version in versions:
        replica.sync(store, target=version)
        want = safetensors.torch.load_file(str(expected / f"{version:08d}.safetensors"))
        assert set(want) == set(replica.tensors)
        for name, tensor in want.items():
            held = replica.tensors[name]
            assert torch.equal(held.view(torch.int16), tensor.view(torch.int16)), (version, name)


def test_ranks_publish_parts_that_replay_bitwise_at_every_version(sharded_run):
    manifest = read_manifest(LocalStore(str(sharded_run / "bucket")))
    assert manifest.latest_version == 11  # the initial weights and 10 steps
    for entry in (*manifest.anchors, *manifest.deltas):
        assert entry.parts is not None and len(entry.parts) == 2
        assert entry.path is None and entry.bytes == sum(p.bytes for p in entry.parts)
    assert [a.version for a in manifest.anchors] == [1, 5, 9]  # sharded anchors as well
    assert {d.encoding for d in manifest.deltas} == {"ctx"}  # coded per rank's rows
    assert_replays_bitwise(sharded_run / "bucket", sharded_run / "exp", range(1, 12))
    cli = subprocess.run(
        [sys.executable, "-m", "deltasync", "verify", str(sharded_run / "bucket"), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "versions 1..11" in cli.stdout, cli.stderr


def test_uneven_shards_and_vocabulary_are_split_by_rows(sharded_run):
    from deltasync.codec import ParsedFile

    manifest = read_manifest(LocalStore(str(sharded_run / "bucket")))
    first = manifest.anchors[0]
    rows = [
        ParsedFile.parse((sharded_run / "bucket" / p.path).read_bytes()).meta.part.rows
        for p in first.parts
    ]
    assert rows[0]["model.embed_tokens.weight"] == (0, 255)  # vocabulary 509: 255 + 254
    assert rows[1]["model.embed_tokens.weight"] == (255, 509)
    assert rows[1]["lm_head.weight"] == (255, 509)


def test_rank_killed_mid_upload_commits_nothing_and_a_restart_resumes(tmp_path):
    bucket, expected = tmp_path / "bucket", tmp_path / "exp"
    crashed = torchrun(
        "--bucket",
        str(bucket),
        "--steps",
        "6",
        "--crash-rank",
        "1",
        "--crash-version",
        "4",
        "--expected",
        str(expected),
        check=False,
    )
    assert crashed.returncode != 0
    store = LocalStore(str(bucket))
    assert read_manifest(store).latest_version == 3  # version 4 was never committed
    assert not list(bucket.rglob("00000004-part1of2-*"))  # rank 1 died before its part landed
    assert_replays_bitwise(bucket, expected, range(1, 4))

    resumed = torchrun(
        "--bucket", str(bucket), "--steps", "3", "--resume", "--expected", str(expected)
    )
    for rank in (0, 1):  # each rank read only its own part of each version
        assert f"rank {rank} replayed its rows from its own parts" in resumed.stderr
    manifest = read_manifest(store)
    assert manifest.latest_version == 7  # 3 + the resumed initial state + 3 steps
    resumed = next(d for d in manifest.deltas if d.version == 4)
    assert resumed.changed_elements == 0  # the restart starts from the bucket's weights
    assert_replays_bitwise(bucket, expected, range(1, 8))


def test_a_failed_part_fails_the_version_on_every_rank(tmp_path):
    bucket = tmp_path / "bucket"
    failed = torchrun(
        "--bucket",
        str(bucket),
        "--steps",
        "4",
        "--crash-rank",
        "1",
        "--crash-version",
        "3",
        "--fail-instead",
        check=False,
    )
    assert failed.returncode != 0
    assert "rank 0: version 3 was not published: rank 1: injected upload failure" in failed.stderr
    assert "rank 1: version 3 was not published" in failed.stderr
    assert read_manifest(LocalStore(str(bucket))).latest_version == 2


def test_partly_sharded_models_are_refused_before_anything_is_written(tmp_path):
    bucket = tmp_path / "bucket"
    refused = torchrun("--bucket", str(bucket), "--steps", "1", "--unsharded-root", check=False)
    assert refused.returncode != 0
    assert "are not sharded while others are" in refused.stderr
    assert not bucket.exists() or not list(bucket.rglob("*.safetensors"))


def test_retention_deletes_every_part_it_drops(tmp_path):
    """keep_anchors=1 with an anchor every 2 versions: each anchor version's own delta is dropped
    at once, with all its parts; nothing the manifest does not name stays behind."""
    bucket = tmp_path / "bucket"
    torchrun(
        "--bucket", str(bucket), "--steps", "5", "--anchor-interval", "2", "--keep-anchors", "1"
    )
    manifest = read_manifest(LocalStore(str(bucket)))
    stored = {str(p.relative_to(bucket)) for p in bucket.rglob("*.safetensors")}
    assert stored == manifest.referenced_paths()
    assert [a.version for a in manifest.anchors] == [5]


def test_moe_ranks_publish_checkpoint_tensors_that_vllm_replays(tmp_path, sharded_moe_run):
    """Qwen3-MoE under FSDP2: each rank holds half of every fused expert tensor and publishes
    the per-expert checkpoint tensors inside it. A one-process replica replays every version
    bit for bit, and vLLM's own MoE model following the bucket holds what a fresh load of each
    exported version holds."""
    sys.path.insert(0, str(ROOT / "tests" / "deltasync" / "vllm_ext"))
    from test_family_sinks import assert_served_equal
    from vllm_in_process import build_vllm_model

    from deltasync.tools.export.version import export
    from deltasync.vllm_ext.apply.inplace import InPlaceSink
    from deltasync.vllm_ext.apply.layout import LayoutOf

    bucket, expected = sharded_moe_run / "bucket", sharded_moe_run / "exp"
    assert_replays_bitwise(bucket, expected, range(1, 7))
    store = LocalStore(str(bucket))
    first = read_manifest(store).anchors[0]
    rows = [ParsedFile.parse((bucket / p.path).read_bytes()).meta.part.rows for p in first.parts]
    expert = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    assert rows[0][expert.format(0)] == (0, 32) and rows[1][expert.format(0)] == (32, 32)
    assert rows[0][expert.format(7)] == (0, 0) and rows[1][expert.format(7)] == (0, 32)
    model_dir = sharded_moe_run / "model"  # config and tokenizer (weights: the bucket's)
    model = build_vllm_model(model_dir)
    replica = Replica(InPlaceSink(model, LayoutOf(model, model.vllm_config)))
    for version in range(1, 7):
        replica.sync(store, target=version)
        export(store, version=version, model=str(model_dir), out=str(tmp_path / f"v{version}"))
        assert_served_equal(model, build_vllm_model(tmp_path / f"v{version}"), f"v{version}")
