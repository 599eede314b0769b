"""`python -m deltasync` inspect / verify / replay on a bucket written by the real publisher."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from model_steps import AdamWLoop, trl_v1_write

from bench.models.qwen3 import tiny_qwen3
from deltasync.defaults import ENCODING
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import LocalStore
from deltasync.tools.cli import main
from deltasync.wire.manifest import read_manifest
from deltasync.wire.metadata import ParsedFile
from deltasync.wire.policy import AnchorPolicy


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bucket")
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-5)
    states = {}
    config = PublisherConfig(run_id="cli-run", policy=AnchorPolicy(interval=4))
    with Publisher(LocalStore(folder), config) as publisher:
        for version in range(1, 10):
            if version > 1:
                loop.step()
            publisher.publish(model)
            states[version] = Bf16Snapshot.capture(model).tensors
    return folder, states


def test_verify_ok(bucket, capsys):
    folder, states = bucket
    assert main(["verify", str(folder), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert (
        "ok: run cli-run, versions 5..9 replayed from the oldest anchor the bucket keeps; "
        "versions 1..4 were retired by the anchor policy: 2 anchors and 4 deltas verified"
    ) in out
    assert f"(state digest {full_state_digest(states[9])})" in out


def test_verify_reads_every_byte_of_a_later_anchor(bucket, tmp_path, capsys):
    """The manifest untouched, one data byte of the later anchor (9) flipped: every cold
    replica would refuse that anchor, so verify must too, naming the tensor."""
    shutil.copytree(bucket[0], tmp_path / "b")
    anchor = max(read_manifest(LocalStore(tmp_path / "b")).anchors, key=lambda a: a.version)
    path = tmp_path / "b" / anchor.path
    header = ParsedFile.parse(path.read_bytes()).header
    name, info = max(header.tensors.items(), key=lambda item: item[1].nbytes)
    data = bytearray(path.read_bytes())
    data[header.data_offset + info.start + info.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "b"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert name in err and "digest" in err and len(err.strip().splitlines()) == 1, err


def test_replay_materialises_a_version_bitwise(bucket, tmp_path):
    folder, states = bucket
    assert main(["replay", str(folder), "--version", "7", "--out", str(tmp_path), "--quiet"]) == 0
    loaded = safetensors.torch.load_file(tmp_path / "model.safetensors")
    for name, tensor in states[7].items():
        assert torch.equal(loaded[name].view(torch.int16), tensor.view(torch.int16))


def test_replay_of_a_deleted_version_says_what_is_available(bucket, tmp_path, capsys):
    folder, _ = bucket
    assert main(["replay", str(folder), "--version", "2", "--out", str(tmp_path)]) == 1
    assert "retained anchors [5, 9]" in capsys.readouterr().err


def test_inspect_json(bucket, capsys):
    folder, states = bucket
    delta = sorted((folder / "runs/cli-run/deltas").iterdir())[-1]
    assert main(["inspect", str(delta), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "delta" and info["version"] == 9 and info["base_version"] == 8
    assert info["encoding"] == ENCODING and 0 < info["sparsity"] < 1
    assert info["state_digest"] == full_state_digest(states[9]).hex()


def test_inspect_of_a_trl_v1_file_shows_its_own_counts(tmp_path, capsys):
    """TRL PR #5417 files declare their totals; the changed count is what their header holds."""
    model = tiny_qwen3()
    base = Bf16Snapshot.capture(model).tensors
    base = {n: t.clone() for n, t in base.items()}
    AdamWLoop(model, lr=1e-3).step()
    path = tmp_path / "step_000002.safetensors"
    new = Bf16Snapshot.capture(model).tensors
    trl_v1_write(path, 2, base, new)
    changed = sum(
        int((base[n].view(torch.int16) != t.view(torch.int16)).sum()) for n, t in new.items()
    )
    total = sum(t.numel() for t in new.values())
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["legacy_trl_v1"] is True and info["kind"] == "delta" and info["version"] == 2
    assert (info["total_elements"], info["changed_elements"]) == (total, changed)
    assert 0 < changed < total and info["sparsity"] == round(1 - changed / total, 6)


def test_verify_detects_a_tampered_file(bucket, tmp_path, capsys):
    folder, _ = bucket
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    delta = sorted((copy / "runs/cli-run/deltas").iterdir())[-1]
    data = bytearray(delta.read_bytes())
    data[-1] ^= 0xFF
    delta.write_bytes(bytes(data))
    assert main(["verify", str(copy), "--quiet"]) == 1
    assert "does not match the manifest" in capsys.readouterr().err


def test_module_entry_point_runs(bucket):
    folder, _ = bucket
    result = subprocess.run(
        [sys.executable, "-m", "deltasync", "verify", str(folder), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_gc_lists_then_removes_only_unreferenced_chain_files(bucket, tmp_path, capsys):
    """Garbage: a killed attempt's delta, a replaced run's anchor. Kept: every file the
    manifest names, metrics records, an upload a live publisher may be about to commit, and
    anything that is not a chain file."""
    shutil.copytree(bucket[0], tmp_path / "b")
    store = LocalStore(tmp_path / "b")
    named = read_manifest(store).referenced_paths()
    planted = {
        "runs/cli-run/deltas/00000007-0123456789ab.safetensors": True,  # a failed attempt's
        "runs/old-run/anchors/00000001-0123456789ab.safetensors": True,  # a replaced run's
        "runs/cli-run/deltas/00000010-0123456789ab.safetensors": False,  # in flight
        "runs/cli-run/metrics/00000099.json": False,
        "runs/cli-run/deltas/notes.txt": False,
    }
    for path in planted:
        store.put(path, b"x" * 10)
    before = set(store.list())
    assert main(["gc", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    garbage = {p for p, is_garbage in planted.items() if is_garbage}
    assert {line.split()[-1] for line in out.splitlines()[:-1]} == garbage
    assert "2 unreferenced files" in out and "dry run" in out
    assert set(store.list()) == before  # a dry run deletes nothing
    assert main(["gc", str(tmp_path / "b"), "--delete", "--quiet"]) == 0
    assert set(store.list()) == before - garbage
    assert named <= set(store.list())
    assert main(["verify", str(tmp_path / "b"), "--quiet"]) == 0


def test_gc_removes_uploads_a_killed_writer_left_once_they_are_old(bucket, tmp_path, capsys):
    """A folder bucket's temporary file of a write that never reached its rename: listed and
    removed with the rest once untouched for an hour; a recent one may be a live upload."""
    shutil.copytree(bucket[0], tmp_path / "b")
    deltas = tmp_path / "b" / "runs" / "cli-run" / "deltas"
    old, live = deltas / ".tmp-killed", deltas / ".tmp-writing"
    old.write_bytes(b"x" * 1000)
    live.write_bytes(b"x" * 10)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert main(["gc", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "runs/cli-run/deltas/.tmp-killed" in out and ".tmp-writing" not in out
    assert "1 unreferenced files" in out and "1 of them uploads never finished" in out
    assert old.exists()  # a dry run
    assert main(["gc", str(tmp_path / "b"), "--delete", "--quiet"]) == 0
    assert not old.exists() and live.exists()


def test_warm_up_compiles_and_checks_one_sync(capsys):
    """`warm-up` runs a publish and a sync through a temporary bucket (the codec's loops are
    compiled on the way) and says how long it took; it leaves nothing behind."""
    before = set(Path(tempfile.gettempdir()).glob("deltasync-warm-up-*"))
    assert main(["warm-up", "--encoding", "packed"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"codec loops compiled and cached \(packed\): \d+\.\d s\n", out), out
    assert set(Path(tempfile.gettempdir()).glob("deltasync-warm-up-*")) == before
