"""The manifest: strict parsing, catch-up plans and retention."""

from __future__ import annotations

import json

import pytest

from deltasync.errors import ChainError, FormatError
from deltasync.wire.manifest import ChainEntry, Manifest, file_path
from deltasync.wire.metadata import PROTOCOL
from deltasync.wire.policy import AnchorPolicy


def _entry(version, kind, size):
    return ChainEntry(
        version,
        kind,
        file_path("run", kind, version, f"{version:032x}"),
        size,
        f"{version:032x}",
        "packed" if kind == "delta" else "full",
        1,
    )


def _chain(last, anchors=(1,), delta_bytes=10, anchor_bytes=1000, keep=2):
    manifest = Manifest("run", 1, (_entry(1, "anchor", anchor_bytes),), (), anchor_bytes)
    for v in range(2, last + 1):
        entries = [_entry(v, "delta", delta_bytes)]
        if v in anchors:
            entries.append(_entry(v, "anchor", anchor_bytes))
        manifest = manifest.with_version(entries, keep_anchors=keep)
    return manifest


def test_json_round_trip():
    manifest = _chain(12, anchors=(1, 5, 9))
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_retention_keeps_newest_anchors_and_their_deltas():
    manifest = _chain(12, anchors=(1, 5, 9), keep=2)
    assert [a.version for a in manifest.anchors] == [5, 9]
    assert [d.version for d in manifest.deltas] == list(range(6, 13))


def test_catch_up_prefers_cheaper_route():
    manifest = _chain(12, anchors=(1, 5, 9))
    assert [e.version for e in manifest.plan("run", 10)] == [11, 12]
    assert [e.version for e in manifest.plan("run", 12)] == []
    fresh = manifest.plan(None, None)
    assert [(e.version, e.kind) for e in fresh] == [
        (9, "anchor"),
        (10, "delta"),
        (11, "delta"),
        (12, "delta"),
    ]
    assert next(e.kind for e in manifest.plan("other-run", 10)) == "anchor"
    assert manifest.plan("run", 2)[0].kind == "anchor"  # no longer covered by deltas
    costly = _chain(12, anchors=(1, 5, 9), delta_bytes=400)
    assert costly.plan("run", 6)[0].kind == "anchor"  # 6 deltas cost more than 9 + 3


def test_reader_ahead_of_bucket_is_an_error():
    with pytest.raises(ChainError):
        _chain(3).plan("run", 7)


def test_version_must_follow():
    with pytest.raises(ChainError):
        _chain(3).with_version([_entry(5, "delta", 1)], keep_anchors=2)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.pop("run_id"),
        lambda m: m.update(extra=1),
        lambda m: m.update(protocol=f"deltasync/{int(PROTOCOL.split('/')[1]) + 1}"),
        lambda m: m.update(latest_version="7"),
        lambda m: m.update(latest_version=99),
        lambda m: m["deltas"].pop(1),
        lambda m: m["deltas"][0].update(path="../../etc/passwd"),
        lambda m: m["deltas"][0].update(bytes=-1),
        lambda m: m.update(anchors=[]),
        lambda m: m.update(run_id="../x"),
        lambda m: m.update(epoch=-1),
        lambda m: m.update(epoch=True),
        lambda m: m.update(previous="zz" * 16),
        lambda m: m.pop("epoch"),
        lambda m: m.update(protocol="deltasync/4"),  # a protocol-4 manifest has no fencing keys
    ],
    ids=[
        "missing-key",
        "unknown-key",
        "protocol",
        "version-type",
        "version-ahead",
        "gap",
        "traversal",
        "negative-size",
        "no-anchor",
        "bad-run-id",
        "negative-epoch",
        "bool-epoch",
        "previous-not-hex",
        "no-epoch",
        "fencing-keys-in-protocol-4",
    ],
)
def test_malformed_manifest_is_refused(mutate):
    raw = json.loads(_chain(6, anchors=(1, 4)).to_json())
    mutate(raw)
    with pytest.raises(FormatError):
        Manifest.from_json(json.dumps(raw).encode())


def test_not_json():
    with pytest.raises(FormatError):
        Manifest.from_json(b"\x00not json")


def test_anchor_policy_rules():
    manifest = _chain(6, anchors=(1,), delta_bytes=100, anchor_bytes=1000)
    assert AnchorPolicy(interval=5, max_delta_fraction=None).wants_anchor(manifest, 7)
    assert not AnchorPolicy(interval=10, max_delta_fraction=None).wants_anchor(manifest, 7)
    assert AnchorPolicy(interval=None, max_delta_fraction=0.5).wants_anchor(manifest, 7)
    assert not AnchorPolicy(interval=None, max_delta_fraction=0.6).wants_anchor(manifest, 7)
    assert AnchorPolicy().wants_anchor(None, 1)
    with pytest.raises(ValueError):
        AnchorPolicy(interval=0)


# The one chain planner, to an exact target (a notification can trail the manifest)


def _plan_entry(kind: str, version: int, size: int = 10) -> ChainEntry:
    folder = "anchors" if kind == "anchor" else "deltas"
    return ChainEntry(version, kind, f"runs/r/{folder}/{version:08d}.st", size, "d", "packed", 1)


def _plan_manifest(anchors: list[int], deltas: range, anchor_bytes: int = 100) -> Manifest:
    return Manifest(
        "r",
        max([*anchors, *deltas]),
        tuple(_plan_entry("anchor", v, anchor_bytes) for v in anchors),
        tuple(_plan_entry("delta", v) for v in deltas),
        anchor_bytes,
    )


def _versions(plan):
    return [(e.kind[0], e.version) for e in plan]


def test_bootstrap_is_nearest_anchor_then_replay():
    m = _plan_manifest([5, 10], range(6, 14))
    assert _versions(m.plan(None, None, 13)) == [("a", 10), ("d", 11), ("d", 12), ("d", 13)]
    assert _versions(m.plan(None, None, 8)) == [("a", 5), ("d", 6), ("d", 7), ("d", 8)]
    assert _versions(m.plan("other-run", 12, 10)) == [("a", 10)]


def test_live_replica_replays_only_up_to_the_target():
    m = _plan_manifest([5, 10], range(6, 14))
    assert _versions(m.plan("r", 11, 12)) == [("d", 12)]
    assert m.plan("r", 12, 12) == []
    big = _plan_manifest([5, 10], range(6, 14), anchor_bytes=5)
    assert _versions(big.plan("r", 6, 11)) == [("a", 10), ("d", 11)]  # cheaper route


def test_unreachable_targets():
    m = _plan_manifest([5, 10], range(6, 14))
    with pytest.raises(ChainError, match="not in the bucket"):
        m.plan("r", 12, 14)
    with pytest.raises(ChainError, match="past the requested"):
        m.plan("r", 13, 12)
    with pytest.raises(ChainError, match="no longer holds"):
        m.plan(None, None, 4)


@pytest.mark.parametrize("delta_digest", ["00000001" * 4, "00000002" * 4, None])
def test_an_anchor_and_a_delta_of_one_version_promise_one_state(delta_digest):
    """Version 4 has an anchor and a delta: their full-state digests must agree (a reader
    replaying through the delta would otherwise fail late); an entry without one (protocol 1)
    is excepted."""
    raw = json.loads(_chain(6, anchors=(1, 4)).to_json())
    for entry in (*raw["anchors"], *raw["deltas"]):
        entry["state_digest"] = "00000001" * 4 if entry["version"] == 4 else None
    (delta,) = [d for d in raw["deltas"] if d["version"] == 4]
    delta["state_digest"] = delta_digest
    data = json.dumps(raw).encode()
    if delta_digest == "00000002" * 4:
        with pytest.raises(FormatError, match="version 4: its anchor and delta promise different"):
            Manifest.from_json(data)
    else:
        assert Manifest.from_json(data).version_digest(4) == "00000001" * 4
