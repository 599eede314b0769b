"""Part files of sharded versions (protocol 3), written here as two ranks would, without a
process group: each part holds its rows, and a reader joins them or refuses them."""

from __future__ import annotations

import json

import pytest
import torch
from sharded_bucket import (
    SHAPES,
    anchor_parts,
    block_sums,
    delta_parts,
    rows_of,
    state_at,
    step,
    write_sharded_bucket,
)

from deltasync.codec import ParsedFile, ParsedParts, PartInfo, encode_delta
from deltasync.errors import DigestMismatch, FormatError
from deltasync.kernels.changes import Diff, TensorChange
from deltasync.kernels.state_hash import full_state_digest, state_sums
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.digests import total
from deltasync.wire.manifest import ChainEntry, Manifest, PartRef, read_manifest


@pytest.mark.parametrize("encoding", ["packed", "coo"])
def test_parts_join_into_the_whole_version_bitwise(encoding):
    v1 = state_at(0)
    v2 = step(v1, 1)
    replica = Replica()
    assert replica.update(anchor_parts(v1), path="v1")
    assert replica.state_digest == full_state_digest(v1)
    assert replica.update(delta_parts(v1, v2, encoding=encoding), path="v2")
    for name in SHAPES:
        assert torch.equal(replica.tensors[name].view(torch.int16), v2[name].view(torch.int16))
    assert replica.state_digest == full_state_digest(v2) == total(state_sums(v2))


def test_a_part_alone_is_refused():
    replica = Replica()
    with pytest.raises(FormatError, match="with all its parts"):
        replica.update(anchor_parts(state_at(0))[0])


def test_missing_or_reordered_parts_are_refused():
    parts = anchor_parts(state_at(0))
    for wrong in ((parts[0],), (parts[1], parts[0]), (parts[0], parts[0])):
        with pytest.raises(FormatError, match="parts"):
            Replica().update(wrong)


def test_parts_of_different_versions_are_refused():
    state = state_at(0)
    first, second = anchor_parts(state, version=1), anchor_parts(state, version=2)
    with pytest.raises(FormatError, match="disagrees with part 0"):
        Replica().update((first[0], second[1]))


def test_a_part_whose_bytes_differ_from_its_digest_is_refused():
    state = state_at(0)
    other = {n: t.clone() for n, t in state.items()}
    other["norm.weight"][4] += 1  # in rank 1's rows
    good = anchor_parts(state)
    forged = anchor_parts(other)
    header = ParsedFile.parse(good[1]).header.metadata  # the digest rank 1 promised for `state`
    tensors = ParsedFile.parse(forged[1])
    import safetensors.torch

    lying = safetensors.torch.save(safetensors.torch.load(tensors.data), metadata=header)
    replica = Replica()
    with pytest.raises(DigestMismatch):
        replica.update((good[0], lying))
    assert replica.version is None


def test_rows_that_do_not_tile_are_refused():
    import safetensors.torch

    parts = list(anchor_parts(state_at(0)))
    parsed = ParsedFile.parse(parts[1])
    meta = dict(parsed.header.metadata)
    rows = json.loads(meta["part_rows"])
    rows["embed.weight"] = [10, 17]  # row 9 is in no part
    meta["part_rows"] = json.dumps(rows)
    entries = json.loads(meta["tensors"])
    entries["embed.weight"][2] = 7 * 8
    meta["tensors"] = json.dumps(entries)
    tensors = safetensors.torch.load(parts[1])
    tensors["embed.weight"] = tensors["embed.weight"][1:].contiguous()
    parts[1] = safetensors.torch.save(tensors, metadata=meta)
    with pytest.raises(FormatError, match="do not tile"):
        ParsedParts.of([ParsedFile.parse(p) for p in parts])


@pytest.mark.parametrize(
    "rows, match",
    [({"embed.weight": [0, 18]}, "bad rows"), ({}, "exactly the file's tensors")],
)
def test_part_rows_are_validated(rows, match):
    import safetensors.torch

    part = anchor_parts(state_at(0))[0]
    meta = dict(ParsedFile.parse(part).header.metadata)
    found = json.loads(meta["part_rows"])
    meta["part_rows"] = json.dumps({} if not rows else found | rows)
    with pytest.raises(FormatError, match=match):
        ParsedFile.parse(safetensors.torch.save(safetensors.torch.load(part), metadata=meta))


def test_delta_part_with_changes_outside_its_rows_is_refused_at_encode():
    v1 = state_at(0)
    change = TensorChange(
        torch.tensor([200]), v1["embed.weight"].view(-1)[:1], v1["embed.weight"].view(-1)[:1]
    )
    diff = Diff({"embed.weight": change}, {}, dict(SHAPES))
    with pytest.raises(FormatError, match="outside the part"):
        encode_delta(
            diff,
            run_id="r",
            version=2,
            base_version=1,
            state_digest=full_state_digest(v1),
            part=PartInfo(0, 2, rows_of(0)),
        )


def _entry(parts, **changes):
    refs = tuple(
        PartRef(f"runs/r/anchors/00000001-part{i}of2-{'ab' * 6}.safetensors", 10, "ab" * 16, d)
        for i, d in enumerate(parts)
    )
    fields = dict(
        version=1,
        kind="anchor",
        path=None,
        bytes=20,
        digest=None,
        encoding="full",
        changed_elements=5,
        state_digest=None,
        parts=refs,
    )
    return fields | changes


def _digests():
    state = state_at(0)
    return [total(block_sums(state, r)).hex() for r in (0, 1)], full_state_digest(state).hex()


def test_sharded_manifest_entry_round_trips():
    parts, whole = _digests()
    raw = _entry(parts, state_digest=whole)
    raw["parts"] = [vars(p) for p in raw["parts"]]
    entry = ChainEntry.from_dict(raw)
    manifest = Manifest("r", 1, (entry,), (), 20)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.referenced_paths() == {p.path for p in entry.parts}
    assert entry.files == entry.parts and "+1 parts" in entry.label


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bytes": 21}, "bytes differ"),
        ({"path": "runs/r/anchors/00000001-abababababab.safetensors"}, "must be null"),
        ({"state_digest": "0" * 32}, "not the sum of its parts"),
    ],
)
def test_sharded_manifest_entry_must_add_up(change, match):
    parts, whole = _digests()
    raw = _entry(parts, state_digest=whole) | change
    raw["parts"] = [vars(p) for p in raw["parts"]]
    with pytest.raises(FormatError, match=match):
        ChainEntry.from_dict(raw)


def test_protocol_2_manifest_entries_have_no_parts_key():
    parts, whole = _digests()
    raw = _entry(parts, state_digest=whole)
    raw["parts"] = [vars(p) for p in raw["parts"]]
    with pytest.raises(FormatError, match="wrong keys"):
        ChainEntry.from_dict(raw, protocol=2)


def test_a_sharded_bucket_syncs_and_verifies(tmp_path):
    states = write_sharded_bucket(tmp_path, versions=4)
    store = LocalStore(str(tmp_path))
    replica = Replica()
    assert replica.sync(store) == [1, 2, 3, 4]
    for name, tensor in states[-1].items():
        assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))
    assert replica.state_digest.hex() == read_manifest(store).deltas[-1].state_digest


def test_unsharded_parameters_on_a_sharded_publisher_are_refused(tmp_path):
    """Plain DDP (every rank holds everything) publishes from rank 0 alone."""
    from types import SimpleNamespace

    from deltasync import Publisher, PublisherConfig
    from deltasync.errors import PublishError

    group = SimpleNamespace(rank=0, size=2)  # refused before any collective
    publisher = Publisher(LocalStore(str(tmp_path)), PublisherConfig(run_id="r"), shards=group)
    with pytest.raises(PublishError, match="rank 0 alone"):
        publisher.publish(state_at(0))
    assert not list(tmp_path.iterdir())


def test_empty_trailing_parts_tile_where_the_rows_end():
    """FSDP2 splits 5 rows over 4 ranks as torch.chunk does: 2, 2, 1, 0; the empty block sits at
    the end of the rows, not at 0."""
    from deltasync.codec import check_tiling

    check_tiling({"w": (5, 3)}, [{"w": (0, 2)}, {"w": (2, 4)}, {"w": (4, 5)}, {"w": (5, 5)}])
    with pytest.raises(FormatError, match="do not tile"):
        check_tiling({"w": (5, 3)}, [{"w": (0, 2)}, {"w": (2, 4)}, {"w": (4, 5)}, {"w": (0, 0)}])
    with pytest.raises(FormatError, match="do not tile"):  # two ranks writing all rows (DDP)
        check_tiling({"w": (5, 3)}, [{"w": (0, 5)}, {"w": (0, 5)}])


def _layout(rank):
    from deltasync.kernels.boxes import Box

    return {n: Box(SHAPES[n], rows_of(rank)[n]) for n in SHAPES}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_replays_its_rows_from_its_own_parts(tmp_path, rank):
    from deltasync.kernels.boxes import box_sums
    from deltasync.publisher.shards import replay_rows

    states = write_sharded_bucket(tmp_path, versions=4)
    store = LocalStore(str(tmp_path))
    blocks, sums = replay_rows(store, read_manifest(store), _layout(rank), rank, 2)
    for name, (start, stop) in rows_of(rank).items():
        assert torch.equal(
            blocks[name].view(torch.int16), states[-1][name][start:stop].view(torch.int16)
        )
    assert sums == box_sums(blocks, _layout(rank))


def test_replaying_rows_of_another_layout_falls_back(tmp_path):
    from deltasync.kernels.boxes import Box
    from deltasync.publisher.shards import replay_rows

    write_sharded_bucket(tmp_path, versions=2)
    store = LocalStore(str(tmp_path))
    other = {n: Box(SHAPES[n], (0, SHAPES[n][0])) for n in SHAPES}
    assert replay_rows(store, read_manifest(store), other, 0, 2) is None
    assert replay_rows(store, read_manifest(store), _layout(0), 0, 4) is None


def test_replaying_rows_refuses_a_part_that_misses_its_digest(tmp_path):
    """A part rewritten with other values (and the manifest made to match its bytes) does not
    lead to the share of the digest it promises."""
    import safetensors.torch

    from deltasync.publisher.shards import replay_rows
    from deltasync.wire.digests import bytes_digest
    from deltasync.wire.manifest import MANIFEST_PATH, file_path

    write_sharded_bucket(tmp_path, versions=2)
    store = LocalStore(str(tmp_path))
    manifest = read_manifest(store)
    ref = manifest.anchors[0].parts[1]
    data = (tmp_path / ref.path).read_bytes()
    tensors = safetensors.torch.load(data)
    tensors["norm.weight"] = tensors["norm.weight"] + 1
    forged = safetensors.torch.save(tensors, metadata=ParsedFile.parse(data).header.metadata)
    digest = bytes_digest(forged)
    path = file_path("r", "anchor", 1, digest, (1, 2))
    (tmp_path / path).write_bytes(forged)
    raw = json.loads(manifest.to_json())
    raw["anchors"][0]["parts"][1] |= {"path": path, "bytes": len(forged), "digest": digest}
    (tmp_path / MANIFEST_PATH).write_text(json.dumps(raw))
    forged_manifest = read_manifest(store)  # consistent: only the part's values lie
    with pytest.raises(DigestMismatch, match="does not lead to its digest"):
        replay_rows(store, forged_manifest, _layout(1), 1, 2)
