"""The replica's running full-state digest: checked on every file, moved in O(changed), and the
full recompute that catches bytes changed in memory without a delta."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

from deltasync import open_store, read_manifest
from deltasync.codec import ParsedFile
from deltasync.errors import ChainError, DigestMismatch, FormatError
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.wire.manifest import fetch_entry, fetch_file
from deltasync.wire.policy import AnchorPolicy

FROZEN = "layer.norm.weight"  # never touched by a delta in these runs


def _states(steps: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    state = {
        "embed.weight": torch.randn(64, 16).bfloat16(),
        FROZEN: torch.ones(16).bfloat16(),
        "proj.weight": torch.randn(16, 16).bfloat16(),
    }
    out = [{n: t.clone() for n, t in state.items()}]
    for step in range(steps):
        state["embed.weight"].view(-1)[step * 7 : step * 7 + 5] += 0.5
        state["proj.weight"][step % 16, :3] *= -1
        out.append({n: t.clone() for n, t in state.items()})
    return out


@pytest.fixture(params=["packed", "coo"])
def bucket(request, tmp_path):
    store = open_store(str(tmp_path / "bucket"))
    config = PublisherConfig(
        run_id="run",
        encoding=request.param,
        policy=AnchorPolicy(interval=1000, max_delta_fraction=100.0),
    )
    states = _states(6)
    with Publisher(store, config) as publisher:
        for state in states:
            publisher.publish(state).result(timeout=60)
    return store, states


def _entry(store, version):
    manifest = read_manifest(store)
    return next(e for e in (*manifest.anchors, *manifest.deltas) if e.version == version)


def _apply(replica, store, version):
    entry = _entry(store, version)
    return replica.update(fetch_entry(store, entry), path=entry.path)


def test_every_version_carries_the_digest_of_the_whole_state(bucket):
    store, states = bucket
    replica = Replica()
    replica.sync(store, target=1)
    for version in range(2, 8):
        assert _apply(replica, store, version)
        expected = full_state_digest(states[version - 1])
        assert replica.state_digest == expected
        assert _entry(store, version).state_digest == expected.hex()


def test_flipped_element_in_an_untouched_tensor_is_caught_by_the_full_recompute(bucket):
    store, states = bucket
    replica = Replica(recompute_every=3)
    replica.sync(store, target=2)  # anchor 1 (a full pass) + delta 2
    replica.sink.state[FROZEN].view(torch.int16)[5] ^= 1  # memory changes, no delta
    # The O(changed) path alone cannot see it: deltas 3 and 4 never touch the tensor.
    assert _apply(replica, store, 3) and _apply(replica, store, 4)
    with pytest.raises(DigestMismatch) as info:
        _apply(replica, store, 5)  # three versions since the last full pass: recompute first
    assert info.value.tensor == FROZEN and "without a delta" in str(info.value)
    assert replica.version is None  # it holds no version of the run any more
    assert replica.sync(store) == [1, 2, 3, 4, 5, 6, 7]  # reloads from the anchor
    for name, tensor in states[-1].items():
        assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_without_periodic_recompute_only_anchors_recompute(bucket):
    store, _ = bucket
    replica = Replica(recompute_every=0)
    replica.sync(store, target=2)
    replica.sink.state[FROZEN].view(torch.int16)[0] ^= 1
    for version in range(3, 8):
        assert _apply(replica, store, version)  # documented: unseen without a full pass


def test_drift_under_a_changed_element_is_named_and_reloads(bucket):
    """Delta 4 changes elements 14..18 of the embedding. Over a drifted element `coo` writes the
    right absolute value and `packed` adds its step to it; either way the O(changed) update
    takes the drifted value out, the full-state digest disagrees, and the replica then checks
    its held bytes and names the tensor."""
    store, states = bucket
    replica = Replica(recompute_every=0)
    replica.sync(store, target=3)
    replica.sink.state["embed.weight"].view(torch.int16).view(-1)[14] ^= 4
    with pytest.raises(DigestMismatch) as info:
        _apply(replica, store, 4)
    assert info.value.tensor == "embed.weight" and "without a delta" in str(info.value)
    assert replica.version is None
    assert replica.sync(store)[-1] == 7
    assert replica.state_digest == full_state_digest(states[-1])


def test_a_file_promising_another_state_digest_is_refused_and_nothing_changes(bucket):
    store, _ = bucket
    replica = Replica()
    replica.sync(store, target=2)
    data = fetch_entry(store, _entry(store, 3))
    parsed = ParsedFile.parse(data)
    metadata = parsed.header.metadata | {"state_digest": "00000001" + "0" * 24}
    forged = safetensors.torch.save(safetensors.torch.load(data), metadata=metadata)
    before = (replica.version, replica.state_digest, replica.digests())
    with pytest.raises(DigestMismatch, match="full-state digest"):
        replica.update(forged)
    assert (replica.version, replica.state_digest, replica.digests()) == before
    assert _apply(replica, store, 3)  # the held state was fine: the real file applies


def test_anchor_whose_state_digest_disagrees_with_its_tensors_is_refused(bucket):
    store, _ = bucket
    data = fetch_file(store, _entry(store, 1).files[0])
    tensors = safetensors.torch.load(data)
    metadata = ParsedFile.parse(data).header.metadata
    tensor_entries = json.loads(metadata["tensors"])  # per-tensor digests stay right
    forged = safetensors.torch.save(
        tensors,
        metadata=metadata | {"state_digest": "0" * 32, "tensors": json.dumps(tensor_entries)},
    )
    replica = Replica()
    with pytest.raises(DigestMismatch, match="full-state digest"):
        replica.update(forged)
    assert replica.version is None and replica.state_digest is None


def test_a_bucket_with_no_manifest_is_no_version(tmp_path):
    """A wrong path (open_store makes the folder) or a bucket nothing was published to: the
    sync says so instead of leaving an empty state that looks synced."""
    replica = Replica()
    with pytest.raises(ChainError, match="has no manifest: nothing was published there"):
        replica.sync(open_store(str(tmp_path / "no-such-bucket")))
    assert replica.version is None and replica.tensors == {}


@pytest.mark.parametrize("kind", ["anchor", "delta"])
def test_a_manifest_entry_must_name_its_files_encoding(bucket, tmp_path, kind):
    """The manifest says how a file is encoded; a file that says otherwise is refused before
    it is decoded, naming both."""
    store, _ = bucket
    folder = tmp_path / "b"
    shutil.copytree(store.root, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    entries = manifest["anchors" if kind == "anchor" else "deltas"]
    other = "ans" if entries[-1]["encoding"] != "ans" else "packed"
    entries[-1]["encoding"] = "virtual" if kind == "anchor" else other
    (folder / "manifest.json").write_text(json.dumps(manifest))
    found = read_manifest(open_store(str(folder)))
    entry = (found.anchors if kind == "anchor" else found.deltas)[-1]
    with pytest.raises(FormatError, match="the manifest says a"):
        fetch_entry(open_store(str(folder)), entry)
