"""The publisher writes the same bytes as before its two pipelines became one: every file name
and every byte of a run's files (full and virtual anchors, deltas of each encoding, per-tensor
digests), pinned as digests recorded by the code that wrote them first.

safetensors writes the metadata's keys in a per-process order (a Rust HashMap), so a file's
pinned digest is taken over its header with sorted keys and its data bytes; its name must hold
the digest of its bytes as written."""

from __future__ import annotations

import json
import struct

import safetensors.torch
import torch

from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import LocalStore
from deltasync.wire.digests import bytes_digest
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource

SHAPES = {"embed.weight": (64, 16), "layers.0.norm.weight": (16,), "lm_head.weight": (48, 16)}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def _step(state: dict[str, torch.Tensor], version: int) -> None:
    """A deterministic change: every 7th element of a few rows, one tensor left alone."""
    for k, name in enumerate(("embed.weight", "lm_head.weight")):
        flat = state[name].view(-1)
        idx = torch.arange(version + k, flat.numel(), 7 + version)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)


def _written(tmp_path, encoding: str, source: ModelSource | None = None) -> dict[str, str]:
    store = LocalStore(tmp_path / f"bucket-{encoding}-{source is not None}")
    state = _state()
    policy = AnchorPolicy(interval=3, max_delta_fraction=None, keep_anchors=5)
    config = PublisherConfig(run_id="bytes", encoding=encoding, policy=policy, source=source)
    with Publisher(store, config) as publisher:
        for version in range(1, 6):
            if version > 1:
                _step(state, version)
            publisher.publish(state).result(timeout=60)
    found = {}
    for path in sorted(store.list("runs")):
        if "/metrics/" in path:  # timings differ
            continue
        data = store.get(path)
        folder, version = path.split("/")[2], int(path.split("/")[3][:8])
        assert path == f"runs/bytes/{folder}/{version:08d}-{bytes_digest(data)[:12]}.safetensors"
        found[f"{folder}/{version}"] = _canonical_digest(data, source)
    return found


def _canonical_digest(data: bytes, source: ModelSource | None) -> str:
    """The digest of the header with sorted keys (and the source's folder, a tmp_path, as
    `<source>`) and of the data bytes."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True)
    if source is not None:
        header = header.replace(source.location, "<source>")
    return bytes_digest(header.encode() + data[8 + size :])


def test_full_anchor_and_deltas_of_each_encoding(tmp_path):
    for encoding in ("ans", "packed", "coo"):
        assert _written(tmp_path, encoding) == EXPECTED[encoding], encoding


def test_a_virtual_first_anchor(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    safetensors.torch.save_file(_state(), str(folder / "model.safetensors"))
    assert _written(tmp_path, "ans", ModelSource("folder", str(folder))) == EXPECTED["virtual"]


EXPECTED: dict[str, dict[str, str]] = {
    "ans": {
        "anchors/1": "3ed09785f8317777409063a456bc36d2",
        "anchors/4": "7660d23ceef2bd0b8bb178ad28474870",
        "deltas/2": "b26314ff6c5c6924ca2d1b5b2164c362",
        "deltas/3": "fe87eeca90c5000f29515ad30d1cf67b",
        "deltas/4": "7a2be4d397c43fe63cdcf04e08c40d05",
        "deltas/5": "347a093eeb3b5b88935e09ecb2dcbe89",
    },
    "coo": {
        "anchors/1": "3ed09785f8317777409063a456bc36d2",
        "anchors/4": "7660d23ceef2bd0b8bb178ad28474870",
        "deltas/2": "3d588bd060d77375c904d9ac8c4f5cc2",
        "deltas/3": "4a1eff0506dd38d26659bf1b498ed2d9",
        "deltas/4": "920cae425c3480be43dad9cf76daf882",
        "deltas/5": "ef6447c75369b122f9e532c721d54fa2",
    },
    "packed": {
        "anchors/1": "3ed09785f8317777409063a456bc36d2",
        "anchors/4": "7660d23ceef2bd0b8bb178ad28474870",
        "deltas/2": "a6655f081c3da709e7004ddd0a9f2c83",
        "deltas/3": "67845b63b8d153b70642b463b17122b2",
        "deltas/4": "b4b36936e5540ed49df8a227440fbc85",
        "deltas/5": "2f68ea08028e2ab4b9f5faf4b6993b14",
    },
    "virtual": {
        "anchors/1": "5ea3e5a2109916fb0e6993f7a23c8527",
        "anchors/4": "7660d23ceef2bd0b8bb178ad28474870",
        "deltas/2": "b26314ff6c5c6924ca2d1b5b2164c362",
        "deltas/3": "fe87eeca90c5000f29515ad30d1cf67b",
        "deltas/4": "7a2be4d397c43fe63cdcf04e08c40d05",
        "deltas/5": "347a093eeb3b5b88935e09ecb2dcbe89",
    },
}
