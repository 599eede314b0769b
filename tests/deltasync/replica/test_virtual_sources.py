"""Sources outside the bucket: a replica loads a virtual anchor only from its own model's folder
or Hub repo (`SourcePolicy`), whatever folder or repo a bucket writer names."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import safetensors.torch
from huggingface_hub._snapshot_download import DryRunFileInfo
from model_steps import HUB_COMMIT, as_hub_cache

from bench.models.qwen3 import tiny_qwen3
from deltasync.codec.virtual import SourcePolicy
from deltasync.errors import FormatError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.manifest import read_manifest
from deltasync.wire.source import ModelSource

OUTSIDE = "outside the folders this replica may read"
SHA = HUB_COMMIT


def _save(model, folder: Path) -> Path:
    folder.mkdir(parents=True)
    safetensors.torch.save_file(Bf16Snapshot.capture(model).tensors, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    return folder


def _bucket(tmp_path: Path, model, source: ModelSource) -> LocalStore:
    """A bucket whose version 1 is a virtual anchor naming `source` (the trainer checked it)."""
    store = LocalStore(tmp_path / "bucket")
    with Publisher(store, PublisherConfig(run_id="run", source=source)) as publisher:
        publisher.publish(model).result(timeout=60)
    assert read_manifest(store).anchors[0].encoding == "virtual"
    return store


@pytest.fixture
def model():
    return tiny_qwen3(seed=3)


def test_a_replica_loads_a_virtual_anchor_from_its_own_model_folder(tmp_path, model):
    mine = _save(model, tmp_path / "mine")
    replica = Replica(sources=SourcePolicy.for_model(str(mine)))
    replica.sync(_bucket(tmp_path, model, ModelSource("folder", str(mine.resolve()))))
    assert replica.version == 1


def test_a_folder_outside_the_replicas_model_is_refused_and_named_nowhere(tmp_path, model):
    """A bucket writer names another folder with the same weights (so digests pass): the
    replica that serves `mine` reads nothing there, and the error says nothing about it."""
    mine = _save(model, tmp_path / "mine")
    elsewhere = _save(model, tmp_path / "elsewhere")
    store = _bucket(tmp_path, model, ModelSource("folder", str(elsewhere.resolve())))
    for sources in (SourcePolicy.for_model(str(mine)), SourcePolicy.for_model("org/model")):
        replica = Replica(sources=sources)
        with pytest.raises(FormatError, match=OUTSIDE) as refused:
            replica.sync(store)
        assert "elsewhere" not in str(refused.value) and replica.version is None
    more = SourcePolicy.for_model(str(mine), more=[elsewhere])  # serve --source-root
    replica = Replica(sources=more)
    replica.sync(store)
    assert replica.version == 1
    assert Replica().sync(store) == [1]  # the CLI (verify, replay, export) reads any source


def test_a_file_linking_outside_the_model_folder_is_refused(tmp_path, model):
    """`model.safetensors -> <a file outside>` in the replica's own folder is not opened."""
    outside = _save(model, tmp_path / "outside")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").symlink_to(outside / "model.safetensors")
    store = _bucket(tmp_path, model, ModelSource("folder", str(mine.resolve())))
    replica = Replica(sources=SourcePolicy.for_model(str(mine)))
    with pytest.raises(FormatError, match=OUTSIDE) as refused:
        replica.sync(store)
    assert "outside" not in str(refused.value).replace(OUTSIDE, "")
    assert replica.version is None


def test_a_model_in_the_hub_cache_layout_loads_through_its_blob_links(tmp_path, model, monkeypatch):
    """Started from a snapshot folder of the Hub cache (files are links into `blobs/`), or by
    its repo id with that cache: the virtual anchor loads, bitwise."""
    cache = tmp_path / "hub"
    snapshot = as_hub_cache(_save(model, tmp_path / "saved"), cache, "org/model")
    store = _bucket(tmp_path, model, ModelSource("folder", str(snapshot)))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for started_with in (str(snapshot), "org/model"):
        replica = Replica(sources=SourcePolicy.for_model(started_with))
        replica.sync(store)
        expected = Bf16Snapshot.capture(model).tensors
        assert all(replica.tensors[n].equal(expected[n]) for n in expected)


def test_a_hub_source_of_another_repo_is_refused_before_any_download(monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("downloaded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    policy = SourcePolicy.for_model("org/model")
    with pytest.raises(FormatError, match="not the repo this replica serves"):
        policy.check(ModelSource("hub", "attacker/huge", SHA), {"w": (4, 4)})


def test_a_hub_source_larger_than_the_model_is_refused_before_the_download(monkeypatch):
    """The Hub's listing of the commit (`snapshot_download(dry_run=True)`) is checked first."""
    calls = []

    def listing(repo_id, *, revision, allow_patterns, dry_run=False):
        calls.append(dry_run)
        assert dry_run, "downloaded"
        size = 10 * 2**30  # 10 GiB for a model of 16 elements
        return [DryRunFileInfo(revision, size, "model.safetensors", "/x", False, True)]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", listing)
    policy = SourcePolicy.for_model("org/model")
    with pytest.raises(FormatError, match="would download 10737418240 bytes"):
        policy.check(ModelSource("hub", "org/model", SHA), {"w": (4, 4)})
    assert calls == [True]


def test_only_a_hub_cache_snapshot_widens_the_root_to_its_repo(tmp_path):
    """A folder merely named `snapshots/x` is its own root; a Hub cache snapshot's root is its
    `models--org--name` folder, where the blobs its files link to live."""
    plain = tmp_path / "data" / "snapshots" / "mine"
    cached = tmp_path / "hub" / "models--org--model" / "snapshots" / HUB_COMMIT
    plain.mkdir(parents=True)
    cached.mkdir(parents=True)
    assert SourcePolicy.for_model(str(plain)).roots == (plain.resolve(),)
    assert SourcePolicy.for_model(str(cached)).roots == (cached.parents[1].resolve(),)
