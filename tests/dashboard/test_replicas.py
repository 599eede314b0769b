"""Replica status on the dashboard: each watched replica's open `/health` (no token anywhere),
its lag behind the bucket, its last pause, and replicas that stopped answering."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gradio_client import Client
from server_process import free_port

from deltasync.wire.manifest import MANIFEST_PATH, Manifest
from spaces.dashboard.app import DashboardConfig, build_dashboard
from spaces.dashboard.replicas import ReplicaPoller, parse_replica_urls
from spaces.dashboard.serving import launch as serve

pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]


class FakeReplica:
    """A loopback server answering `/health` as a rollout server does (`body`, or `status`)."""

    def __init__(self, body: dict | None = None, status: int = 200):
        self.body, self.status, self.requests = body or {}, status, []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                replica.requests.append((self.path, self.headers.get("Authorization")))
                data = json.dumps(replica.body).encode()
                self.send_response(replica.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet():
    replicas = {
        "current": FakeReplica({"status": "ok", "version": 9, "last_pause_s": 0.042}),
        "behind": FakeReplica({"status": "ok", "version": 6, "last_pause_s": 0.05}),
        "paused": FakeReplica({"version": 8, "paused": True, "syncing_version": 9}),
        "broken": FakeReplica({"error": "engine dead"}, status=503),
    }
    yield replicas
    for replica in replicas.values():
        replica.stop()


def test_each_replica_is_shown_with_its_lag_pause_and_state(fleet):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    poller = ReplicaPoller((*(r.url for r in fleet.values()), down), min_poll_s=0.0)
    statuses = {s.url: s for s in poller.statuses(latest=9)}
    current, behind = statuses[fleet["current"].url], statuses[fleet["behind"].url]
    assert (current.state, current.version, current.lag) == ("ok", 9, 0)
    assert current.last_pause_s == pytest.approx(0.042)
    assert (behind.state, behind.lag) == ("behind", 3) and "3 version(s) behind" in behind.detail
    assert statuses[fleet["paused"].url].state == "paused"
    assert statuses[fleet["broken"].url].state == "down"
    assert "HTTP 503" in statuses[fleet["broken"].url].detail
    assert statuses[down].state == "down" and "never answered" in statuses[down].detail
    for replica in fleet.values():  # the public dashboard holds no token and asks nothing else
        assert replica.requests == [("/health", None)]


def test_a_replica_that_stops_answering_shows_when_it_last_did(fleet):
    replica = fleet["current"]
    poller = ReplicaPoller((replica.url,), min_poll_s=0.0, timeout_s=1.0)
    assert poller.statuses(latest=9)[0].state == "ok"
    replica.stop()
    (status,) = poller.statuses(latest=10)
    assert status.state == "down" and "last answered" in status.detail
    assert status.version == 9 and status.lag == 1  # what it served when last seen


def test_polls_are_rate_limited(fleet):
    replica = fleet["current"]
    poller = ReplicaPoller((replica.url,), min_poll_s=60.0)
    for _ in range(5):
        poller.statuses(latest=9)
    assert len(replica.requests) == 1


@pytest.mark.parametrize("text", ["ftp://x", "127.0.0.1:8000", "http://", "http://h/?q=1"])
def test_replica_urls_are_checked(text):
    with pytest.raises(ValueError, match="http"):
        parse_replica_urls(text)


def test_series_endpoint_returns_lag_per_replica(trainer, fleet):
    trainer.publish(9)
    urls = (fleet["current"].url, fleet["behind"].url)
    demo = build_dashboard(trainer.store, DashboardConfig(refresh_s=60.0, replicas=urls))
    port = free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        series = client.predict(api_name="/series")
        lags = {r["url"]: (r["version"], r["lag"], r["state"]) for r in series["replicas"]}
        assert lags == {urls[0]: (9, 0, "ok"), urls[1]: (6, 3, "behind")}
        table = client.predict(api_name="/refresh")[-1]
        assert [row[:4] for row in table["data"]] == [
            [urls[0], "ok", 9, 0],
            [urls[1], "behind", 6, 3],
        ]
    finally:
        demo.close()


def test_an_idle_run_stops_the_polling_and_says_why(fleet):
    """A request to a Space counts as activity: once the run has committed nothing for
    `idle_after_s`, an open dashboard must not keep GPU replicas awake (or wake them)."""
    replica = fleet["current"]
    poller = ReplicaPoller((replica.url,), min_poll_s=0.0, idle_after_s=900.0)
    assert poller.statuses(latest=9, idle_s=60.0)[0].state == "ok"  # live: polled
    for _ in range(3):
        (status,) = poller.statuses(latest=9, idle_s=901.0)
    assert len(replica.requests) == 1  # idle: no more requests
    assert (status.state, status.version) == ("ok", 9)  # what it served when last seen
    assert status.detail.startswith("not polled: the run has committed nothing for 15 min")
    assert poller.statuses(latest=10, idle_s=5.0)[0].lag == 1  # a new commit: polled again
    assert len(replica.requests) == 2


def test_series_stops_polling_replicas_of_a_run_idle_for_15_minutes(trainer, fleet):
    trainer.publish(9)
    manifest = Manifest.from_json(trainer.store.get(MANIFEST_PATH))
    stale = dataclasses.replace(manifest, updated_at=manifest.updated_at - 1000.0)
    trainer.store.publish(MANIFEST_PATH, stale.to_json())  # its last commit 16 min ago
    urls = (fleet["current"].url,)
    demo = build_dashboard(trainer.store, DashboardConfig(refresh_s=60.0, replicas=urls))
    port = free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    try:
        series = Client(f"http://127.0.0.1:{port}/", verbose=False).predict(api_name="/series")
    finally:
        demo.close()
    [row] = series["replicas"]
    assert row["detail"].startswith("not polled: the run has committed nothing for 1")
    assert fleet["current"].requests == []
