"""A replica outcome's commit-to-serving latency keys: optional for records written before they
existed (those still load), all three or none, each checked."""

from __future__ import annotations

import json

import pytest
from test_metrics import _record

from deltasync.errors import FormatError
from deltasync.wire.metrics import ReplicaOutcome, SyncRecord

OLD_OUTCOME = {"ok": True, "attempts": 1, "stage_s": 0.4, "pause_s": 0.02, "total_s": 0.5}


def _with_replicas(replicas: dict) -> bytes:
    raw = json.loads(_record().to_json())
    raw.update(replicas=replicas, sync_s=0.6, step=2, reward_mean=0.25)
    return json.dumps(raw).encode()


def test_an_outcome_written_before_latency_loads_without_one():
    record = SyncRecord.from_json(_with_replicas({"vllm-0": OLD_OUTCOME | {"error": None}}))
    (outcome,) = record.replicas
    assert (outcome.latency_s, outcome.served_version, outcome.following) == (None, None, False)
    assert outcome.pause_s == 0.02 and not outcome.superseded(record.version)


def test_latency_keys_round_trip_and_mark_a_superseded_version():
    outcomes = (
        ReplicaOutcome("vllm-0", True, 1, latency_s=2.5, served_version=5),
        ReplicaOutcome("follower-0", True, 1, latency_s=1.0, served_version=5, following=True),
        ReplicaOutcome("vllm-1", True, 1, 0.3, 0.04, 0.4, latency_s=0.9, served_version=3),
    )
    record = _record().with_sync(outcomes, sync_s=2.5, step=2, reward_mean=None)
    assert SyncRecord.from_json(record.to_json()) == record
    raw = json.loads(record.to_json())["replicas"]
    assert raw["follower-0"] == OLD_OUTCOME | {
        "stage_s": 0.0,
        "pause_s": 0.0,
        "total_s": 0.0,
        "error": None,
        "latency_s": 1.0,
        "served_version": 5,
        "following": True,
    }
    # version 3 of a driven replica served at 5: superseded; a follower seen at 5 is not
    assert [o.superseded(3) for o in record.replicas] == [True, False, False]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"latency_s": 1.0}, "has keys"),  # some latency keys but not all
        ({"latency_s": -1.0, "served_version": 3, "following": False}, "latency_s"),
        ({"latency_s": 1.0, "served_version": 0, "following": False}, "served_version"),
        ({"latency_s": 1.0, "served_version": 3, "following": 1}, "following"),
    ],
)
def test_latency_keys_are_checked(extra, message):
    data = _with_replicas({"vllm-0": OLD_OUTCOME | {"error": None} | extra})
    with pytest.raises(FormatError, match=message):
        SyncRecord.from_json(data)
