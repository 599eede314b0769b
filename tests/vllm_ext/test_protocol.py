"""Control messages of the weight-transfer backend."""

from __future__ import annotations

import pytest

from deltasync.errors import FormatError
from deltasync.vllm_ext.protocol import InitInfo, UpdateInfo, parse_message, parse_version


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
