"""Protocol versions: files of protocols 1-6 written by earlier code still read, bitwise; a
newer file or manifest is refused with one line naming both versions."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch

from deltasync import Replica, open_store, read_manifest
from deltasync.codec import PROTOCOL, ParsedFile, ctx, decode, read_metadata
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.wire.manifest import Manifest, fetch_entry, fetch_file

FIXTURES = Path(__file__).parents[2] / "fixtures" / "protocol-1"
FIXTURES_2 = Path(__file__).parents[2] / "fixtures" / "protocol-2"
FIXTURES_3 = Path(__file__).parents[2] / "fixtures" / "protocol-3"
FIXTURES_4 = Path(__file__).parents[2] / "fixtures" / "protocol-4"
FIXTURES_5 = Path(__file__).parents[2] / "fixtures" / "protocol-5"
FIXTURES_6 = Path(__file__).parents[2] / "fixtures" / "protocol-6"
NEWER = f"deltasync/{int(PROTOCOL.split('/')[1]) + 1}"


@pytest.mark.parametrize("encoding", ["packed", "coo"])
def test_protocol_1_buckets_replay_bitwise(encoding):
    store = open_store(str(FIXTURES / f"bucket-{encoding}"))
    manifest = read_manifest(store)
    assert manifest.protocol == "deltasync/1" and manifest.latest_version == 4
    first, last = sorted(manifest.anchors, key=lambda a: a.version)
    replica = Replica()
    replica.update(fetch_entry(store, first), path=first.path)
    for delta in manifest.deltas:
        assert replica.update(fetch_entry(store, delta), path=delta.path)
    assert replica.version == 4
    anchor = safetensors.torch.load(fetch_file(store, last.files[0]))
    assert set(anchor) == set(replica.tensors)
    for name, tensor in anchor.items():
        assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))
    meta, _ = read_metadata(lambda a, b: fetch_file(store, last.files[0])[a:b], last.bytes)
    replica.check_digests(meta)


def _with_protocol(data: bytes, protocol: str) -> bytes:
    parsed = ParsedFile.parse(data)
    tensors = safetensors.torch.load(data)
    return safetensors.torch.save(tensors, metadata=parsed.header.metadata | {"protocol": protocol})


def test_newer_file_is_refused_naming_both_versions():
    delta = next((FIXTURES / "bucket-packed").rglob("00000002-*.safetensors"))
    with pytest.raises(FormatError) as info:
        ParsedFile.parse(_with_protocol(delta.read_bytes(), NEWER))
    message = str(info.value)
    assert NEWER in message and PROTOCOL in message and "upgrade" in message
    assert "\n" not in message


def test_newer_manifest_is_refused_before_its_keys_are_checked():
    raw = json.loads((FIXTURES / "bucket-packed" / "manifest.json").read_bytes())
    raw |= {"protocol": NEWER, "fence": {"epoch": 3}}  # a field this reader lacks
    with pytest.raises(FormatError) as info:
        Manifest.from_json(json.dumps(raw).encode())
    assert NEWER in str(info.value) and PROTOCOL in str(info.value)
    assert "keys" not in str(info.value)


@pytest.mark.parametrize("found", ["deltasync/0", "other/1", "", None])
def test_unknown_protocol_names_what_was_found(found):
    raw = json.loads((FIXTURES / "bucket-packed" / "manifest.json").read_bytes())
    raw["protocol"] = found
    with pytest.raises(FormatError, match=f"this reader speaks {PROTOCOL}"):
        Manifest.from_json(json.dumps(raw).encode())


@pytest.mark.parametrize("encoding", ["packed", "coo"])
def test_protocol_2_buckets_replay_bitwise_with_their_state_digests(encoding):
    """The files' state digests were computed when protocol 2 was introduced: a change of the
    digest's definition (keys, primes, index or value mapping) fails here."""
    store = open_store(str(FIXTURES_2 / f"bucket-{encoding}"))
    manifest = read_manifest(store)
    assert manifest.protocol == "deltasync/2" and manifest.latest_version == 4
    replica = Replica()
    first = min(manifest.anchors, key=lambda a: a.version)
    replica.update(fetch_entry(store, first), path=first.path)
    assert replica.state_digest.hex() == first.state_digest
    for delta in manifest.deltas:
        assert replica.update(fetch_entry(store, delta), path=delta.path)
        assert replica.state_digest.hex() == delta.state_digest
    anchor = safetensors.torch.load(fetch_file(store, manifest.latest_anchor.files[0]))
    assert full_state_digest(anchor).hex() == manifest.latest_anchor.state_digest
    assert full_state_digest(replica.tensors) == replica.state_digest


def test_protocol_3_sharded_bucket_replays_bitwise():
    """Part files of protocol 3 (two ranks' rows, `packed`): joined, verified, bitwise."""
    from sharded_bucket import state_at, step

    store = open_store(str(FIXTURES_3 / "bucket-sharded-packed"))
    manifest = read_manifest(store)
    assert manifest.protocol == "deltasync/3" and manifest.latest_version == 4
    assert all(len(e.parts) == 2 for e in (*manifest.anchors, *manifest.deltas))
    states = [state_at(0)]
    for seed in range(1, 4):
        states.append(step(states[-1], seed))
    replica = Replica()
    replica.sync(store)
    assert replica.version == 4
    assert replica.state_digest.hex() == manifest.deltas[-1].state_digest
    for name, tensor in states[-1].items():
        assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_protocol_1_run_resumed_by_a_newer_publisher(tmp_path):
    """A run started before the upgrade goes on: its old entries keep no state digest, new
    versions carry one, and a fresh replica replays the mixed chain."""
    shutil.copytree(FIXTURES / "bucket-packed", tmp_path / "bucket")
    store = open_store(str(tmp_path / "bucket"))
    replica = Replica()
    replica.sync(store)
    state = {n: t.clone() for n, t in replica.tensors.items()}
    config = PublisherConfig(run_id="fixture-packed", write_metrics=False, takeover=True)
    with Publisher(store, config) as pub:
        state["embed.weight"][0, 0] += 1
        pub.publish(state).result(timeout=60)
    manifest = read_manifest(store)
    assert manifest.protocol == PROTOCOL and manifest.latest_version == 5
    assert manifest.deltas[-1].state_digest is not None
    assert all(d.state_digest is None for d in manifest.deltas[:-1])
    fresh = Replica()
    assert fresh.sync(store)[-1] == 5
    assert fresh.state_digest.hex() == manifest.deltas[-1].state_digest
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_manifest_entry_must_name_the_files_state_digest(tmp_path):
    shutil.copytree(FIXTURES_2 / "bucket-packed", tmp_path / "bucket")
    store = open_store(str(tmp_path / "bucket"))
    manifest = read_manifest(store)
    entry = replace(manifest.deltas[0], state_digest="0" * 32)
    with pytest.raises(FormatError, match="state digest"):
        fetch_entry(store, entry)


def test_protocol_4_ans_bucket_replays_and_is_taken_over(tmp_path):
    """`ans` files of protocol 4 replay with their state digests; the manifest (no fencing
    keys) reads as epoch 0, and a newer publisher's takeover writes epoch 1 under protocol 5."""
    shutil.copytree(FIXTURES_4 / "bucket-ans", tmp_path / "bucket")
    store = open_store(str(tmp_path / "bucket"))
    manifest = read_manifest(store)
    assert manifest.protocol == "deltasync/4" and (manifest.epoch, manifest.previous) == (0, None)
    assert [d.encoding for d in manifest.deltas] == ["ans"] * 3
    replica = Replica()  # from version 1, every delta: anchor 3 is cheaper for a cold reader
    for entry in (min(manifest.anchors, key=lambda a: a.version), *manifest.deltas):
        assert replica.update(fetch_entry(store, entry), path=entry.label)
        assert replica.state_digest.hex() == entry.state_digest
    assert replica.version == 4
    assert Manifest.from_json(manifest.to_json()) == manifest  # written back as protocol 4
    config = PublisherConfig(run_id="fixture-ans", write_metrics=False, takeover=True)
    state = {n: t.clone() for n, t in replica.tensors.items()}
    state["layer.proj.weight"][0, 0] += 1
    with Publisher(store, config) as publisher:
        assert publisher.publish(state).result(timeout=60).version == 5
    after = read_manifest(store)
    assert (after.protocol, after.epoch, after.latest_version) == (PROTOCOL, 1, 5)
    assert replica.sync(store) == [5]


def test_protocol_5_bucket_replays_and_a_newer_publisher_writes_ctx_under_protocol_6(tmp_path):
    """`ans` files and the fenced manifest of protocol 5 replay with their state digests; a
    takeover goes on under protocol 6 with a `ctx` delta, which the replica applies bitwise."""
    shutil.copytree(FIXTURES_5 / "bucket-ans", tmp_path / "bucket")
    store = open_store(str(tmp_path / "bucket"))
    manifest = read_manifest(store)
    assert (manifest.protocol, manifest.epoch, manifest.latest_version) == ("deltasync/5", 1, 4)
    replica = Replica()
    for entry in (min(manifest.anchors, key=lambda a: a.version), *manifest.deltas):
        assert replica.update(fetch_entry(store, entry), path=entry.label)
        assert replica.state_digest.hex() == entry.state_digest
    config = PublisherConfig(
        run_id="fixture-v5", write_metrics=False, takeover=True, encoding="ctx"
    )
    state = {n: t.clone() for n, t in replica.tensors.items()}
    state["embed.weight"][3] += 1
    with Publisher(store, config) as publisher:
        assert publisher.publish(state).result(timeout=60).version == 5
    after = read_manifest(store)
    assert (after.protocol, after.epoch, after.deltas[-1].encoding) == (PROTOCOL, 2, "ctx")
    assert replica.sync(store) == [5]
    assert all(
        torch.equal(replica.tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in state.items()
    )


def test_a_protocol_5_file_naming_ctx_is_refused():
    delta = next((FIXTURES_5 / "bucket-ans").rglob("00000002-*.safetensors"))
    parsed = ParsedFile.parse(delta.read_bytes())
    metadata = parsed.header.metadata | {"encoding": "ctx", "format": "deltasync_ctx"}
    blob = safetensors.torch.save(safetensors.torch.load(delta.read_bytes()), metadata=metadata)
    with pytest.raises(FormatError, match="encoding"):
        ParsedFile.parse(blob)


def _held(change, box: Box, width: int):
    """(box-local indices, new bits, base bits) of a whole tensor's changes inside `box`."""
    rows, cols = change.indices // width, change.indices % width
    c0, c1 = box.cols or (0, width)
    inside = (rows >= box.rows[0]) & (rows < box.rows[1]) & (cols >= c0) & (cols < c1)
    local = (rows[inside] - box.rows[0]) * (c1 - c0) + cols[inside] - c0
    bits = (change.values[inside], change.previous[inside])
    return (local, *(b.view(torch.int16) for b in bits))


def test_protocol_6_ctx_bucket_replays_bitwise_whole_by_box_and_on_device():
    """`ctx` deltas written when it became the default: a whole replica replays them with
    their state digests; workers holding half of `embed.weight`'s rows or half its columns
    decode the same changes of what they hold; so does the device decoder (torch, on CPU)."""
    store = open_store(str(FIXTURES_6 / "bucket-ctx"))
    manifest = read_manifest(store)
    assert (manifest.protocol, manifest.latest_version) == ("deltasync/6", 4)
    assert [d.encoding for d in manifest.deltas] == ["ctx"] * 3
    replica = Replica()
    for entry in (manifest.anchors[0], *manifest.deltas):
        base = {n: t.clone() for n, t in replica.tensors.items()}
        data = fetch_entry(store, entry)
        assert replica.update(data, path=entry.label)
        assert replica.state_digest.hex() == entry.state_digest
        if entry.kind != "delta":
            continue
        whole = decode(data, base=base).changes["embed.weight"]
        embed = base["embed.weight"]
        for box in (Box((128, 64), (64, 128)), Box((128, 64), (0, 128), (32, 64))):
            boxes = {n: Box.whole(tuple(t.shape)) for n, t in base.items()} | {"embed.weight": box}
            part = embed[box.rows[0] : box.rows[1], slice(*(box.cols or (0, 64)))].contiguous()
            got = decode(data, base=base | {"embed.weight": part}, boxes=boxes)
            got = got.changes["embed.weight"]
            want = _held(whole, box, 64)
            assert torch.equal(got.indices, want[0])
            assert torch.equal(got.values.view(torch.int16), want[1])
            assert torch.equal(got.previous.view(torch.int16), want[2])
        blob = safetensors.torch.load(data)["embed.weight.ctx"]
        steps = ctx.decode_on_device(blob, whole.indices.numel(), embed, (128, 64), chunk=512)
        assert torch.equal(steps.indices, whole.indices)
        base_bits = embed.view(-1).view(torch.int16)[steps.indices].int()
        new_bits = (base_bits + steps.values.view(torch.int16).int()).to(torch.int16)
        assert torch.equal(new_bits, whole.values.view(torch.int16))
    assert replica.version == 4
