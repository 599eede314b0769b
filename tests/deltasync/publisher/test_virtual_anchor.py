"""Virtual first anchors: version 1 names the checkpoint the trainer started from (a local folder
stands in for the Hub here) instead of carrying the weights; replicas load and verify it."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from model_steps import AdamWLoop
from test_publisher import _equal

from bench.models.qwen3 import tiny_qwen3
from deltasync.codec import ParsedFile, decode, encode_virtual_anchor
from deltasync.errors import DigestMismatch, FormatError
from deltasync.kernels.boxes import Box
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.manifest import read_manifest
from deltasync.wire.source import ModelSource, resolve_source


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Qwen3 saved as a bf16 checkpoint folder (two shards), and the model in fp32."""
    model = tiny_qwen3(seed=5)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    state = Bf16Snapshot.capture(model).tensors
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        tensors = {n: state[n] for n in part}
        safetensors.torch.save_file(tensors, folder / f"model-0000{i + 1}-of-00002.safetensors")
    (folder / "config.json").write_text("{}")
    return model, folder


def _publish(store, model, source, steps=2):
    config = PublisherConfig(run_id="run", source=source)
    loop = AdamWLoop(model, lr=1e-3)
    records = []
    with Publisher(store, config) as publisher:
        for i in range(steps + 1):
            if i:
                loop.step()
            records.append(publisher.publish(model).result(timeout=60))
    return records


def test_first_version_names_the_checkpoint_and_replicas_reach_the_trainer(tmp_path, checkpoint):
    model, folder = checkpoint
    store = LocalStore(tmp_path / "bucket")
    source = resolve_source(str(folder))
    assert source == ModelSource("folder", str(folder.resolve()))
    records = _publish(store, model, source)
    first = read_manifest(store).anchors[0]
    assert (first.version, first.encoding) == (1, "virtual")
    model_bytes = records[0].full_bytes
    assert first.bytes < 20_000 < model_bytes  # a header, not the weights
    assert first.fetch_bytes == model_bytes  # what a cold replica reads from the source
    replica = Replica()
    replica.sync(store)
    assert replica.version == 3 and _equal(replica, model)


def test_a_source_differing_in_one_element_is_refused(tmp_path, checkpoint):
    model, folder = checkpoint
    store = LocalStore(tmp_path / "bucket")
    _publish(store, model, resolve_source(str(folder)), steps=0)
    path = sorted(folder.glob("*.safetensors"))[0]
    tensors = safetensors.torch.load_file(path)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] += 1
    safetensors.torch.save_file(tensors, path)
    replica = Replica()
    with pytest.raises(DigestMismatch, match=name):
        replica.sync(store)
    assert replica.version is None and not replica.tensors  # nothing served


def test_a_model_that_moved_from_its_checkpoint_gets_a_full_anchor(tmp_path, checkpoint, caplog):
    model, folder = checkpoint
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    store = LocalStore(tmp_path / "bucket")
    with caplog.at_level("WARNING"):
        _publish(store, model, resolve_source(str(folder)), steps=0)
    assert read_manifest(store).anchors[0].encoding == "full"
    assert "differ from the checkpoint" in caplog.text


def test_missing_or_malformed_sources_are_clear_errors(tmp_path, checkpoint):
    model, _ = checkpoint
    state = Bf16Snapshot.capture(model).tensors
    gone = ModelSource("folder", str(tmp_path / "nowhere"))
    data = encode_virtual_anchor(state, gone, run_id="run", version=1)
    with pytest.raises(FormatError, match="does not exist"):
        decode(data)
    for kind, location, revision in (
        ("folder", "relative/path", None),
        ("hub", "Qwen/Qwen3-1.7B", "main"),  # a branch, not a pinned commit
        ("hub", "../x", "0" * 40),
        ("ftp", "/x", None),
    ):
        with pytest.raises(FormatError):
            ModelSource(kind, location, revision)
    for text in ("", "[]", '{"kind": "folder"}', '{"kind":"folder","location":1,"revision":null}'):
        with pytest.raises(FormatError):
            ModelSource.from_json(text)
    assert resolve_source("not a repo id!") is None
    carrying = safetensors.torch.save(
        {"x": torch.zeros(2, dtype=torch.bfloat16)}, metadata=ParsedFile.parse(data).header.metadata
    )
    with pytest.raises(FormatError, match="holds no tensors"):
        decode(carrying)


def test_a_virtual_anchor_carries_no_tensors_and_names_its_source(checkpoint):
    model, folder = checkpoint
    state = Bf16Snapshot.capture(model).tensors
    source = ModelSource("folder", str(folder))
    data = encode_virtual_anchor(state, source, run_id="run", version=1)
    parsed = ParsedFile.parse(data)
    assert parsed.header.tensors == {} and parsed.meta.source == source
    assert parsed.header.metadata["format"] == "deltasync_virtual"  # no loader takes it
    decoded = decode(data)
    for name, tensor in state.items():
        assert torch.equal(decoded.tensors[name].view(torch.int16), tensor.view(torch.int16))
    name = "model.embed_tokens.weight"
    shape = tuple(state[name].shape)
    box = Box(shape, (3, 9), (4, 20), True)  # a tensor-parallel worker's slice
    boxes = {n: Box.whole(tuple(t.shape)) for n, t in state.items()} | {name: box}
    sliced = decode(data, boxes=boxes)
    assert torch.equal(
        sliced.tensors[name].view(torch.int16), state[name][3:9, 4:20].view(torch.int16)
    )
    norm = "model.norm.weight"
    assert torch.equal(sliced.tensors[norm].view(torch.int16), state[norm].view(torch.int16))
