"""The latency chart: commit-to-serving latency per version, one line per replica (followers
named as such), a placeholder for records written without latency, and the page serves it."""

from __future__ import annotations

import pytest
from gradio_client import Client

from deltasync.wire.manifest import metrics_path
from deltasync.wire.metrics import ReplicaOutcome, SyncRecord
from spaces.dashboard import charts
from spaces.dashboard.data import BucketWatcher, WatcherConfig
from spaces.dashboard.series import latency_series, series_json

from .test_app import refresh

pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]


def _snapshot(store):
    return BucketWatcher(store, WatcherConfig(min_poll_s=0.0)).snapshot()


def _with_follower(trainer, version: int, latency_s: float) -> None:
    """Add a follower's outcome (seen by the trainer's poll) to a completed record."""
    path = metrics_path("run-a", version)
    record = SyncRecord.from_json(trainer.store.get(path))
    seen = ReplicaOutcome(
        "follower-0", True, 1, latency_s=latency_s, served_version=version, following=True
    )
    complete = record.with_sync(
        (*record.replicas, seen), sync_s=1.0, step=record.step, reward_mean=record.reward_mean
    )
    trainer.store.put(path, complete.to_json())


def test_latency_series_has_one_line_per_replica(trainer):
    trainer.publish(3)
    assert latency_series(_snapshot(trainer.store)) == []  # publisher-only records
    placeholder = charts.latency_chart([])
    assert placeholder["layer"][0]["mark"]["type"] == "text"
    for v in (1, 2, 3):
        trainer.complete(v, {"vllm-0": (0.3, 0.02)}, reward=None)
        _with_follower(trainer, v, 1.5)
    rows = series_json(_snapshot(trainer.store))["latency"]
    assert {(r["version"], r["series"]) for r in rows} == {
        (v, s) for v in (1, 2, 3) for s in ("vllm-0", "follower-0 (following)")
    }
    assert sorted({round(r["seconds"], 6) for r in rows}) == [0.52, 1.5]
    chart = charts.latency_chart(rows)
    assert "latency" in chart["title"]
    assert chart["layer"][0]["encoding"]["color"]["scale"]["domain"] == [
        "follower-0 (following)",
        "vllm-0",
    ]


def test_the_page_shows_the_latency_chart(trainer, launch):
    trainer.publish(4)
    for v in range(1, 5):
        trainer.complete(v, {"vllm-0": (0.3, 0.02), "vllm-1": (0.4, 0.03)}, reward=0.1)
    out = refresh(Client(launch(trainer.store.root), verbose=False))
    latency = out["latency"]
    assert latency["title"] == "Commit-to-serving latency per replica (s)"
    points = {(p["version"], p["series"]) for p in latency["data"]["values"]}
    assert points == {(v, r) for v in range(1, 5) for r in ("vllm-0", "vllm-1")}
