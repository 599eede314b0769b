"""Control messages of the weight-transfer backend."""

from __future__ import annotations

import pytest

from deltasync.errors import FormatError
from deltasync.vllm_ext.protocol import (
    InitInfo,
    SyncRequest,
    UpdateInfo,
    merge_statuses,
    parse_message,
    parse_version,
    stage_args,
    stage_manifest,
)
from deltasync.wire.manifest import MAX_MANIFEST_BYTES


def test_messages_are_validated():
    assert UpdateInfo(version="7").version == 7
    assert parse_version("3") == 3 and parse_version(2**63 - 1) == 2**63 - 1
    for bad in (0, -1, True, "x", 1.5, None, 2**63):
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
    for bad in (-1, True, 1.5, "5", 10**7):
        with pytest.raises(FormatError, match="recompute_every"):
            InitInfo(bucket="/tmp/b", recompute_every=bad)
    assert InitInfo(bucket="/tmp/b", recompute_every=0).recompute_every == 0


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


@pytest.mark.parametrize(
    "text", ["٢", "²", "3²", "１", " 3 ", "+3", "-3", "0", "", "3.0", "1" * 20]
)
def test_versions_are_ascii_digits_only(text):
    """`str.isdigit` accepts "٢" (int() reads it as 2) and "²" (int() raises ValueError): both
    are one-line FormatErrors here, before any staging slot is touched."""
    with pytest.raises(FormatError) as info:
        stage_args(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_stage_arguments_are_strings():
    assert stage_args("7") == (7, None)
    assert stage_args("7", "runs/r/deltas/x.safetensors") == (7, "runs/r/deltas/x.safetensors")
    for version, path in ((7, ""), ("7", ["x"]), ("7", 3), (None, ""), ("7", "../x")):
        with pytest.raises(FormatError):
            stage_args(version, path)
    with pytest.raises(FormatError, match="at most 1024"):
        stage_args("7", "a" * 100_000)


def test_a_followers_manifest_is_bytes_within_the_manifest_limit():
    assert stage_manifest(None) is None
    assert stage_manifest(b"{}") == b"{}"
    for bad in ("{}", {"run_id": "r"}, bytearray(b"{}")):
        with pytest.raises(FormatError, match="must be bytes"):
            stage_manifest(bad)
    with pytest.raises(FormatError, match="exceeds"):
        stage_manifest(b" " * (MAX_MANIFEST_BYTES + 1))


def test_a_sync_request_takes_a_json_integer():
    assert parse_message(SyncRequest, {"version": 7}, "sync") == SyncRequest(7)
    for bad in ({"version": "7"}, {"version": 7.0}, {"version": False}, {"version": 7, "x": 1}):
        with pytest.raises(ValueError):
            parse_message(SyncRequest, bad, "sync")


def test_the_workers_status_lists_what_each_read():
    worker = {"run_id": "r", "version": 3, "state_digest": "d", "staging": {}, "busy": False}
    first = worker | {"bytes_read": 700, "last_update": {"version": 3, "bytes_read": 70}}
    second = worker | {"bytes_read": 500, "last_update": {"version": 3, "bytes_read": 50}}
    merged = merge_statuses([first, second])
    assert merged["bytes_read"] == [700, 500] and merged["version"] == 3
    assert merged["last_read"] == [70, 50]  # what each read for the last update
    assert merge_statuses([worker, worker])["last_read"] == [None, None]  # none applied yet
