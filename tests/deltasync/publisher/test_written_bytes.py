"""The publisher writes the same bytes as before its two pipelines became one: every file name
and every byte of a run's files (full and virtual anchors, deltas of each encoding, per-tensor
digests), pinned as digests recorded by the code that wrote them first. Re-pinned at protocol 6,
whose files differ only in their `protocol` key (the same run written under protocol 5 gave the
earlier pins); `ctx` deltas pinned since.

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
    for encoding in ("ans", "ctx", "packed", "coo"):
        assert _written(tmp_path, encoding) == EXPECTED[encoding], encoding


def test_a_virtual_first_anchor(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    safetensors.torch.save_file(_state(), str(folder / "model.safetensors"))
    assert _written(tmp_path, "ans", ModelSource("folder", str(folder))) == EXPECTED["virtual"]


EXPECTED: dict[str, dict[str, str]] = {
    "ans": {
        "anchors/1": "1e54247e4538ae42743db01f324248e2",
        "anchors/4": "9968e73eca49b8614b4e9b70cc09d153",
        "deltas/2": "19aefd438deb75cbcf3af2bf8519c701",
        "deltas/3": "99cc1a2d54e6b22df6516c6f139c68d2",
        "deltas/4": "d50d0f6571656e4af4fe792c07de29e4",
        "deltas/5": "35bb479e47f89bc184276597a5cf2957",
    },
    "coo": {
        "anchors/1": "1e54247e4538ae42743db01f324248e2",
        "anchors/4": "9968e73eca49b8614b4e9b70cc09d153",
        "deltas/2": "3faf7be0f77e424c0c936018f8995236",
        "deltas/3": "e2eaa601b1b6fb151b3bdfb3dedbfa29",
        "deltas/4": "b7743d463f66535a977d13b3b9324b6a",
        "deltas/5": "37a5128e34491cf38172bdc0e31e4120",
    },
    "ctx": {
        "anchors/1": "1e54247e4538ae42743db01f324248e2",
        "anchors/4": "9968e73eca49b8614b4e9b70cc09d153",
        "deltas/2": "8c59886dbb50f2e3d87fb6db9ed71403",
        "deltas/3": "9f7054352d10e41f480bc12371298739",
        "deltas/4": "3c17000155beed14e5748950453ffe29",
        "deltas/5": "83296c184d92945f3d5ea1cd67cad0e9",
    },
    "packed": {
        "anchors/1": "1e54247e4538ae42743db01f324248e2",
        "anchors/4": "9968e73eca49b8614b4e9b70cc09d153",
        "deltas/2": "0b8f05a0be432d9fb56c3dae238493d0",
        "deltas/3": "4bf8f4c8e99c8cba3a8272564ac07577",
        "deltas/4": "163cabb45bdab1c24154c49bb270ba57",
        "deltas/5": "c4d3b7cfe1bfbf0591f93b17d5ed06ea",
    },
    "virtual": {
        "anchors/1": "c38c14a569fc2cccc9164368c0e8e1bd",
        "anchors/4": "9968e73eca49b8614b4e9b70cc09d153",
        "deltas/2": "19aefd438deb75cbcf3af2bf8519c701",
        "deltas/3": "99cc1a2d54e6b22df6516c6f139c68d2",
        "deltas/4": "d50d0f6571656e4af4fe792c07de29e4",
        "deltas/5": "35bb479e47f89bc184276597a5cf2957",
    },
}
