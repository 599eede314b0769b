"""Control messages and the catch-up plan to an exact version."""

from __future__ import annotations

import pytest

from deltasync.errors import ChainError, FormatError
from deltasync.manifest import ChainEntry, Manifest
from deltasync.vllm_ext.protocol import (
    InitInfo,
    UpdateInfo,
    parse_message,
    parse_version,
    plan_to,
)


def _entry(kind: str, version: int, size: int = 10) -> ChainEntry:
    folder = "anchors" if kind == "anchor" else "deltas"
    return ChainEntry(version, kind, f"runs/r/{folder}/{version:08d}.st", size, "d", "packed", 1)


def _manifest(anchors: list[int], deltas: range, anchor_bytes: int = 100) -> Manifest:
    return Manifest(
        "r",
        max([*anchors, *deltas]),
        tuple(_entry("anchor", v, anchor_bytes) for v in anchors),
        tuple(_entry("delta", v) for v in deltas),
        anchor_bytes,
    )


def _versions(plan):
    return [(e.kind[0], e.version) for e in plan]


def test_bootstrap_is_nearest_anchor_then_replay():
    m = _manifest([5, 10], range(6, 14))
    assert _versions(plan_to(m, None, None, 13)) == [("a", 10), ("d", 11), ("d", 12), ("d", 13)]
    assert _versions(plan_to(m, None, None, 8)) == [("a", 5), ("d", 6), ("d", 7), ("d", 8)]
    assert _versions(plan_to(m, "other-run", 12, 10)) == [("a", 10)]


def test_live_replica_replays_only_up_to_the_target():
    m = _manifest([5, 10], range(6, 14))
    assert _versions(plan_to(m, "r", 11, 12)) == [("d", 12)]
    assert plan_to(m, "r", 12, 12) == []
    big = _manifest([5, 10], range(6, 14), anchor_bytes=5)
    assert _versions(plan_to(big, "r", 6, 11)) == [("a", 10), ("d", 11)]  # cheaper route


def test_unreachable_targets():
    m = _manifest([5, 10], range(6, 14))
    with pytest.raises(ChainError, match="not in the bucket"):
        plan_to(m, "r", 12, 14)
    with pytest.raises(ChainError, match="past the requested"):
        plan_to(m, "r", 13, 12)
    with pytest.raises(ChainError, match="no longer holds"):
        plan_to(m, None, None, 4)


def test_messages_are_validated():
    assert UpdateInfo(version="7").version == 7
    assert parse_version(" 3 ") == 3
    for bad in (0, -1, True, "x", 1.5, None):
        with pytest.raises(FormatError):
            UpdateInfo(version=bad)
    with pytest.raises(FormatError, match="path"):
        UpdateInfo(version=2, path="../manifest.json")
    with pytest.raises(FormatError, match="bucket"):
        InitInfo(bucket="")
    with pytest.raises(FormatError, match="verify"):
        InitInfo(bucket="/tmp/b", verify="yes")
    with pytest.raises(FormatError, match="prepack"):
        InitInfo(bucket="/tmp/b", prepack=0)


def test_credentials_never_come_from_a_request():
    info = parse_message(InitInfo, {"bucket": "s3://b/x", "verify": False}, "init_info")
    assert info == InitInfo("s3://b/x", verify=False)
    for extra in ({"token": "hf_x"}, {"storage_options": {"key": "k"}}, {"aws_secret": "s"}):
        with pytest.raises(ValueError, match="unknown init_info keys"):
            parse_message(InitInfo, {"bucket": "s3://b/x", **extra}, "init_info")
    with pytest.raises(ValueError, match="JSON object"):
        parse_message(UpdateInfo, [7], "update_info")
    with pytest.raises(ValueError, match="invalid update_info"):
        parse_message(UpdateInfo, {}, "update_info")
