"""Replicas holding boxes (tensor-parallel workers): each applies only its box of every tensor,
bit for bit, and the version is verified only when the workers' digest shares combine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_steps import AdamWLoop
from sharded_bucket import SHAPES, write_sharded_bucket

from bench.models.qwen3 import tiny_qwen3
from bench.tp_slices import CountingStore
from deltasync.codec import ParsedFile
from deltasync.errors import DigestMismatch, FormatError
from deltasync.kernels.boxes import Box, check_cover
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.replica.sinks import DictSink
from deltasync.store import LocalStore
from deltasync.wire.digests import total
from deltasync.wire.manifest import fetch_entry, fetch_file, read_manifest
from deltasync.wire.policy import AnchorPolicy

FIXTURES_1 = Path(__file__).parents[2] / "fixtures" / "protocol-1"


def tp_boxes(rank: int, size: int = 2):
    """Boxes as vLLM slices a model: 2-D `*proj`/`mlp` by columns for `o_proj`/`down_proj`,
    by rows for the others (uneven where the rows do not divide); 1-D replicated, owned by 0."""

    def boxes_of(shapes):
        boxes = {}
        for name, shape in shapes.items():
            if len(shape) < 2:
                boxes[name] = Box.whole(shape, owner=rank == 0)
                continue
            by_cols = "o_proj" in name or "down_proj" in name or name == "proj.weight"
            n = shape[1] if by_cols else shape[0]
            per = -(-n // size)  # a padded vocabulary: the last rank holds fewer rows
            span = (min(rank * per, n), min((rank + 1) * per, n))
            boxes[name] = Box(shape, (0, shape[0]), span) if by_cols else Box(shape, span)
        return boxes

    return boxes_of


def workers(size: int = 2) -> list[Replica]:
    return [Replica(DictSink(tp_boxes(rank, size))) for rank in range(size)]


def sync_all(replicas: list[Replica], store, target=None, *, whole=False) -> list[int]:
    """What the engines do: each worker prepares alone, then they exchange digest shares.
    `whole`: every file read whole first (else an anchor's boxes are read by byte range)."""
    manifest = read_manifest(store)
    prepared = []
    for replica in replicas:
        plan = manifest.plan(replica.run_id, replica.version, target)
        if whole:
            files = [(_whole(store, e), e.label) for e in plan]
        else:
            files = [(fetch_entry(store, e), e.label) for e in plan]
        prepared.append(replica.stage(files))
    combined = [total(list(shares)) for shares in zip(*(p.partials for p in prepared), strict=True)]
    applied = [r.commit(p, combined) for r, p in zip(replicas, prepared, strict=True)]
    assert applied[0] == applied[1]
    return applied[0]


def assert_slices(replicas, expected, shapes):
    for rank, replica in enumerate(replicas):
        boxes = tp_boxes(rank, len(replicas))(shapes)
        for name, tensor in expected.items():
            held = replica.tensors[name]
            assert torch.equal(held.view(torch.int16), boxes[name].take(tensor).view(torch.int16))


def test_workers_hold_their_slices_of_a_sharded_bucket(tmp_path):
    states = write_sharded_bucket(tmp_path, versions=5)
    store = LocalStore(str(tmp_path))
    replicas = workers()
    check_cover([tp_boxes(r)(SHAPES) for r in (0, 1)], SHAPES)
    assert sync_all(replicas, store, target=2) == [1, 2]
    assert_slices(replicas, states[1], SHAPES)
    assert sync_all(replicas, store) == [3, 4, 5]
    assert_slices(replicas, states[-1], SHAPES)
    expected = read_manifest(store).deltas[-1].state_digest
    assert all(r.state_digest.hex() == expected for r in replicas)
    assert replicas[0].tensors["embed.weight"].shape == (9, 8)
    assert replicas[1].tensors["proj.weight"].shape == (3, 2)


@pytest.mark.parametrize("encoding", ["packed", "coo"])
def test_workers_replay_real_training_bitwise(tmp_path, encoding):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-5)
    store = LocalStore(str(tmp_path))
    policy = AnchorPolicy(interval=4, max_delta_fraction=None, keep_anchors=2)
    publisher = Publisher(store, PublisherConfig(run_id="r", encoding=encoding, policy=policy))
    replicas, late = workers(), None
    for version in range(1, 8):
        if version > 1:
            loop.step()
        publisher.publish(model).result(timeout=60)
        expected = Bf16Snapshot.capture(model).tensors
        shapes = {n: tuple(t.shape) for n, t in expected.items()}
        assert sync_all(replicas, store) == [version]
        assert_slices(replicas, expected, shapes)
        if version == 6:  # a worker pair that starts late replays from the anchor
            late = workers()
            assert sync_all(late, store) == [5, 6]
            assert_slices(late, expected, shapes)
    publisher.close()
    check_cover([tp_boxes(r)(shapes) for r in (0, 1)], shapes)


def test_a_wrong_share_refuses_the_version_on_every_worker(tmp_path):
    write_sharded_bucket(tmp_path, versions=3)
    store = LocalStore(str(tmp_path))
    replicas = workers()
    sync_all(replicas, store, target=2)
    manifest = read_manifest(store)
    entry = manifest.deltas[-1]
    prepared = [r.stage([(fetch_entry(store, entry), entry.label)]) for r in replicas]
    wrong = prepared[0].partials[0]  # rank 1's share left out
    for replica, update in zip(replicas, prepared, strict=True):
        with pytest.raises(DigestMismatch, match="full-state digest mismatch"):
            replica.commit(update, [wrong])
        with pytest.raises(ValueError, match="combined digests"):
            replica.commit(update)
        assert replica.version == 2


def test_box_index_maps_round_trip():
    box = Box((6, 10), (1, 5), (3, 7))
    full = torch.arange(60)
    local, kept = box.localize(full.numpy())
    assert local.tolist() == list(range(box.numel))
    assert torch.equal(box.globalize(torch.from_numpy(local)), full[torch.from_numpy(kept)])
    assert torch.equal(box.take(full.reshape(6, 10)).reshape(-1), full[torch.from_numpy(kept)])
    rows = Box((6, 10), (2, 4))
    local, kept = rows.localize(np.array([5, 20, 25, 39, 40]))
    assert local.tolist() == [0, 5, 19] and kept == slice(1, 4)


def test_slices_that_miss_or_overlap_are_refused():
    shapes = {"w": (4, 6)}
    with pytest.raises(FormatError, match="exactly once"):
        check_cover([{"w": Box((4, 6), (0, 2))}, {"w": Box((4, 6), (1, 4))}], shapes)
    with pytest.raises(FormatError, match="exactly once"):
        check_cover(
            [{"w": Box((4, 6), (0, 4), (0, 3))}, {"w": Box((4, 6), (0, 4), (4, 6))}], shapes
        )
    check_cover([{"w": Box((4, 6), (0, 4), (0, 3))}, {"w": Box((4, 6), (0, 4), (3, 6))}], shapes)
    with pytest.raises(FormatError, match="do not fit"):
        Box((4, 6), (0, 5))


def _whole(store, entry):
    found = tuple(fetch_file(store, f) for f in entry.files)
    return found[0] if entry.parts is None else found


def test_a_protocol_1_file_is_refused_by_a_sliced_replica():
    """Protocol 1 files carry no full-state digest, so no slice of them can be verified."""
    store = LocalStore(str(FIXTURES_1 / "bucket-packed"))
    entry = min(read_manifest(store).anchors, key=lambda a: a.version)
    with pytest.raises(FormatError, match="tensor parallel size 1"):
        workers()[0].stage([(fetch_entry(store, entry), entry.path)])


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "parts"])
def test_workers_read_only_their_slices_of_an_anchor(tmp_path, sharded, monkeypatch):
    # the tiny model's tensors are close, and its anchor smaller than the head read with its header
    monkeypatch.setattr("deltasync.wire.stored.MERGE_GAP", 0)
    monkeypatch.setattr("deltasync.wire.stored.HEAD_BYTES", 4096)
    if sharded:
        states = write_sharded_bucket(tmp_path, versions=3)
        expected, shapes = states[-1], SHAPES
    else:
        model = tiny_qwen3()
        publisher = Publisher(LocalStore(str(tmp_path)), PublisherConfig(run_id="r"))
        publisher.publish(model).result(timeout=60)
        publisher.close()
        expected = Bf16Snapshot.capture(model).tensors
        shapes = {n: tuple(t.shape) for n, t in expected.items()}
    store = CountingStore(str(tmp_path))
    anchor = read_manifest(store).anchors[0]
    store.read = 0
    ranged, whole = workers(), workers()
    sync_all(ranged, store)
    read_ranged, store.read = store.read, 0
    sync_all(whole, store, whole=True)
    for a, b in zip(ranged, whole, strict=True):
        assert a.version == b.version and a.state_digest == b.state_digest
        for name in expected:
            assert torch.equal(a.tensors[name].view(torch.int16), b.tensors[name].view(torch.int16))
    assert_slices(ranged, expected, shapes)
    if not sharded:  # two workers read about one anchor between them, not two
        assert store.read >= 2 * anchor.bytes
        assert read_ranged < 0.7 * store.read, (read_ranged, store.read)


def test_a_truncated_anchor_is_refused_by_a_ranged_read(tmp_path):
    model = tiny_qwen3()
    publisher = Publisher(LocalStore(str(tmp_path)), PublisherConfig(run_id="r"))
    publisher.publish(model).result(timeout=60)
    publisher.close()
    store = LocalStore(str(tmp_path))
    anchor = read_manifest(store).anchors[0]
    path = tmp_path / anchor.path
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(FormatError):
        sync_all(workers(), store)


def test_a_tampered_norm_is_refused_by_the_worker_that_does_not_own_it(tmp_path):
    """A ranged read skips the whole-file digest; a norm held whole by every worker but counted
    only by rank 0 is still checked against the anchor's per-tensor digest on rank 1."""
    model = tiny_qwen3()
    publisher = Publisher(LocalStore(str(tmp_path)), PublisherConfig(run_id="r"))
    publisher.publish(model).result(timeout=60)
    publisher.close()
    store = LocalStore(str(tmp_path))
    entry = read_manifest(store).anchors[0]
    parsed = ParsedFile.parse(store.get(entry.path))
    info = parsed.header.tensors["model.norm.weight"]
    data = bytearray(parsed.data)
    data[parsed.header.data_offset + info.start] ^= 1
    (tmp_path / entry.path).write_bytes(bytes(data))
    rank1 = workers()[1]
    with pytest.raises(DigestMismatch) as caught:
        rank1.stage([(fetch_entry(store, entry), entry.label)])
    assert caught.value.tensor == "model.norm.weight"
