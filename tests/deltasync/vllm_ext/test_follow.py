"""The follower (`serve --follow`) against a folder bucket of hand-written manifests and a stand-in
engine client (no server): it syncs only through the control plane's path, never goes backwards,
backs off on an unreadable bucket with one log line per change of state, and a push to the
version it already serves is a no-op. The real server runs in `test_follow_server.py`."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import pytest
from standin_engine import StandInEngine

from deltasync.store import open_store
from deltasync.vllm_ext.server.app import BearerAuthMiddleware
from deltasync.vllm_ext.server.control import ControlConfig, ControlError, ControlPlane
from deltasync.vllm_ext.server.follow import FollowConfig, Follower
from deltasync.wire.manifest import MANIFEST_PATH, ChainEntry, Manifest, file_path

TOKEN = "s3cret-token"
INTERVAL = 2.0


def digest(run: str, version: int) -> str:
    """A stand-in full-state digest of `version` of `run` (32 hex digits, lanes below primes)."""
    return f"{sum(map(ord, run)):016x}{version:016x}"


def manifest(
    run: str, latest: int, *, anchors=(1,), updated_at: float | None = None, forked: int = 0
) -> Manifest:
    """A manifest of `run` at `latest`: `anchors` and every delta after the oldest of them."""

    def entry(kind: str, version: int) -> ChainEntry:
        state = digest(run + ("-fork" if version == forked else ""), version)
        name = f"{version:032x}"
        path = file_path(run, kind, version, name)
        return ChainEntry(version, kind, path, 100, name, "packed", 10, state)

    deltas = tuple(entry("delta", v) for v in range(min(anchors) + 1, latest + 1))
    return Manifest(
        run_id=run,
        latest_version=latest,
        anchors=tuple(entry("anchor", a) for a in anchors),
        deltas=deltas,
        model_bytes=100,
        updated_at=time.time() if updated_at is None else updated_at,
    )


class Engine(StandInEngine):
    """vLLM's `AsyncLLM` as the control plane uses it; its one worker applies whatever version
    it is asked for (the real staging and checks are the engine's, tested elsewhere)."""

    def __init__(self, bucket: str | None, run: str | None = "r", held: int | None = 3):
        self.bucket, self.run, self.held = bucket, run, held
        self.weight_version = "default" if held is None else str(held)
        self.digest = None if held is None else digest(run, held)
        self.calls: list[str] = []
        self.staging: dict[str, str] = {}
        self.stage_error: str | None = None
        self.rpc_kwargs: list[tuple[str, dict]] = []  # staging and apply calls, with kwargs

    async def __call__(self, scope, receive, send):  # vLLM's own app: /health, lifespan
        if scope["type"] == "lifespan":
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self, *args):
        return True

    def status(self):
        return {
            "bucket": self.bucket,
            "run_id": self.run,
            "version": self.held,
            "state_digest": self.digest,
            "staging": dict(self.staging),
            "busy": False,
            "last_update": {"bytes": 10, "files": ["f"], "swapped": True},
        }

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        kwargs = kwargs or {}
        if method in ("deltasync_stage", "deltasync_apply"):
            self.rpc_kwargs.append((method, dict(kwargs)))
        if method == "deltasync_stage":
            error = self.stage_error
            self.staging[kwargs["version"]] = f"failed: {error}" if error else "ready"
        elif method == "deltasync_apply":
            self.held = int(kwargs["version"])
            self.staging.pop(kwargs["version"], None)
            self.run = self.bucket_run
            self.digest = digest(self.run, self.held)
            return [self.status() | {"error": None, "error_type": None}]
        return [self.status()]


class Setup:
    def __init__(self, tmp_path, **engine):
        self.folder = tmp_path / "bucket"
        self.store = open_store(str(self.folder))
        self.engine = Engine(str(self.folder), **engine)
        self.control = ControlPlane(ControlConfig(poll_s=0.001))
        config = FollowConfig(interval_s=INTERVAL, max_backoff_s=30.0)
        self.follower = Follower(self.control, config, rng=random.Random(0))
        self.control.follower = self.follower

    def publish(self, m: Manifest) -> None:
        self.engine.bucket_run = m.run_id
        self.store.publish(MANIFEST_PATH, m.to_json())

    def poll(self) -> float:
        return asyncio.run(asyncio.wait_for(self.follower.poll(self.engine), 30))

    def syncs(self) -> list[str]:
        return [c for c in self.engine.calls if c.startswith("record")]


@pytest.fixture(autouse=True)
def _info_logs(caplog):
    caplog.set_level(logging.INFO, logger="deltasync")


def messages(caplog) -> list[str]:
    """The follower's log lines after its first (which names the bucket and the interval)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "deltasync.follow"]
    return [line for line in lines if "polling" not in line]


def test_a_new_version_is_synced_through_the_control_planes_path(tmp_path):
    s = Setup(tmp_path)
    s.publish(manifest("r", 3))
    s.poll()
    assert s.follower.status == "up to date" and s.syncs() == []
    s.engine.calls.clear()
    s.publish(manifest("r", 5))
    delay = s.poll()
    assert 0.8 * INTERVAL <= delay <= 1.2 * INTERVAL
    assert s.engine.calls == [
        "deltasync_status",  # the follower: what do the workers hold?
        "deltasync_status",  # the control plane's sync, as for a push
        "deltasync_stage",  # ready at once here; the real engine is polled until it is
        "pause",
        "deltasync_apply",
        "record 5",
        "resume",
    ]
    state = s.follower.state()
    assert state["served_version"] == 5 and state["versions_behind"] == 0
    assert state["synced"] == 1 and state["last_sync"]["previous_version"] == 3
    s.engine.calls.clear()
    for _ in range(3):  # unchanged bytes: one read of the manifest each, nothing else
        s.poll()
    assert s.engine.calls == [] and s.follower.status == "up to date"
    s.publish(manifest("r", 7))
    s.poll()
    assert s.syncs() == ["record 7"]


def test_the_workers_stage_from_the_manifest_bytes_the_poll_read(tmp_path):
    """One manifest read per version: the poll's bytes go to the workers' staging (in
    process), which plans from them instead of reading the manifest again."""
    s = Setup(tmp_path)
    s.publish(manifest("r", 5))
    polled = s.store.get(MANIFEST_PATH)
    s.poll()
    assert s.syncs() == ["record 5"]
    assert s.engine.rpc_kwargs == [
        ("deltasync_stage", {"version": "5", "path": "", "manifest": polled}),
        ("deltasync_apply", {"version": "5", "path": ""}),  # takes that staging
    ]
    body = {"method": "deltasync_stage", "kwargs": {"version": "6", "manifest": "{}"}}
    with pytest.raises(ControlError) as refused:  # never from a request
        asyncio.run(s.control.rpc(s.engine, body))
    assert refused.value.status == 422 and "manifest" in str(refused.value)


@pytest.mark.parametrize(
    ("bucket", "expected"),
    [
        (manifest("r", 2), "past the requested 2"),  # behind the served version
        (manifest("r", 4, forked=3), "fork"),  # another publisher rewrote version 3
    ],
)
def test_an_older_manifest_or_a_fork_is_ignored_until_it_moves_forward(
    tmp_path, caplog, bucket, expected
):
    s = Setup(tmp_path)
    s.publish(bucket)
    for _ in range(3):
        assert s.poll() <= 1.2 * INTERVAL  # not an error: no backoff
    lines = messages(caplog)
    assert len(lines) == 1 and expected in lines[0] and "keeping version 3" in lines[0]
    assert s.syncs() == [] and "deltasync_stage" not in s.engine.calls
    assert s.follower.state()["status"] == "ignoring"
    s.publish(manifest("r", 6))
    s.poll()
    assert s.syncs() == ["record 6"]


def test_another_run_is_followed_but_never_an_older_one(tmp_path, caplog):
    s = Setup(tmp_path)
    s.publish(manifest("r", 4))
    s.poll()
    s.publish(manifest("new", 2))  # a new run replaced the bucket's
    s.poll()
    assert s.syncs() == ["record 4", "record 2"] and s.engine.run == "new"
    s.publish(manifest("r", 9, updated_at=time.time() - 3600))  # a stale read of the old run
    s.poll()
    assert s.syncs() == ["record 4", "record 2"] and s.engine.run == "new"
    assert "committed before the run new" in messages(caplog)[-1]


def test_an_empty_bucket_waits_for_its_first_version(tmp_path, caplog):
    s = Setup(tmp_path, run=None, held=None)
    for _ in range(3):
        assert s.poll() <= 1.2 * INTERVAL
    assert s.follower.status == "empty" and s.syncs() == []
    s.publish(manifest("r", 3, anchors=(1, 3)))
    s.poll()
    assert s.syncs() == ["record 3"] and s.engine.weight_version == "3"
    assert len([m for m in messages(caplog) if "empty" in m]) == 1


def test_waits_for_the_bucket_before_reading_anything(tmp_path):
    s = Setup(tmp_path)
    s.engine.bucket = None
    s.poll()
    s.poll()
    assert s.follower.status == "waiting" and s.engine.calls == ["deltasync_status"] * 2


@pytest.mark.parametrize("outage", ["folder renamed away", "manifest replaced by an error page"])
def test_an_unreadable_bucket_backs_off_logs_once_and_resumes(tmp_path, caplog, outage):
    s = Setup(tmp_path)
    s.publish(manifest("r", 3))
    s.poll()
    saved = (s.folder / MANIFEST_PATH).read_bytes()
    away = tmp_path / "away"
    if outage == "folder renamed away":
        s.folder.rename(away)
    else:
        (s.folder / MANIFEST_PATH).write_bytes(b"<html><body>502 Bad Gateway</body></html>")
    delays = [s.poll() for _ in range(6)]
    for failures, delay in enumerate(delays, start=1):
        base = min(30.0, INTERVAL * 2**failures)
        assert 0.8 * base <= delay <= 1.2 * base, (failures, delays)
    state = s.follower.state()
    assert state["status"] == "retrying" and state["failures"] == 6
    assert state["served_version"] == 3 and s.syncs() == []
    health = s.control.health()["follow"]
    assert health["last_error"] in ("no manifest", "unreadable manifest")  # no paths on /health
    assert str(s.folder) not in json.dumps(health)
    if outage == "folder renamed away":
        away.rename(s.folder)
    else:
        (s.folder / MANIFEST_PATH).write_bytes(saved)
    s.publish(manifest("r", 4))
    assert s.poll() <= 1.2 * INTERVAL
    assert s.syncs() == ["record 4"] and s.follower.state()["failures"] == 0
    lines = messages(caplog)
    assert len([m for m in lines if "retrying with backoff" in m]) == 1, lines
    assert len([m for m in lines if "following again after 6 failed polls" in m]) == 1, lines


def test_a_failed_sync_is_planned_again_at_the_next_poll(tmp_path, caplog):
    """Retention deleted a file the staging was downloading: the sync fails before any pause;
    the next poll reads the manifest again and syncs."""
    s = Setup(tmp_path)
    s.publish(manifest("r", 5))
    s.engine.stage_error = "MissingFile: get runs/r/deltas/x: no such file"
    delay = s.poll()
    assert 0.8 * 2 * INTERVAL <= delay <= 1.2 * 2 * INTERVAL
    assert "pause" not in s.engine.calls and s.follower.status == "retrying"
    s.engine.stage_error = None
    s.poll()
    assert s.syncs() == ["record 5"] and s.follower.status == "up to date"
    assert len(messages(caplog)) == 2  # the failure, and the recovery


def test_a_refused_version_is_not_retried_until_the_manifest_changes(tmp_path, caplog):
    s = Setup(tmp_path)
    s.publish(manifest("r", 5))
    s.engine.stage_error = "DigestMismatch: digest mismatch for tensor 'w'"
    s.poll()
    stages = s.engine.calls.count("deltasync_stage")
    for _ in range(3):
        assert s.poll() <= 1.2 * INTERVAL
    assert s.engine.calls.count("deltasync_stage") == stages and s.syncs() == []
    assert len(messages(caplog)) == 1 and "was refused" in messages(caplog)[0]
    state, public = s.follower.state(), s.follower.state(public=True)
    assert state["status"] == "ignoring" and "DigestMismatch" in state["last_error"]
    assert public["last_error"] == "refused" and public["last_error_at"] is not None
    s.engine.stage_error = None
    s.publish(manifest("r", 6))
    s.poll()
    assert s.syncs() == ["record 6"]


def test_a_push_to_the_version_already_served_is_a_noop(tmp_path):
    s = Setup(tmp_path)
    s.publish(manifest("r", 5))
    s.poll()
    s.engine.calls.clear()
    answer = asyncio.run(s.control.sync(s.engine, {"version": 5}))
    assert answer["noop"] is True and answer["version"] == 5 and answer["pause_s"] == 0.0
    assert s.engine.calls == ["deltasync_status"]  # no staging, no pause
    s.publish(manifest("other", 5))  # the same number in another run is a real sync
    answer = asyncio.run(s.control.sync(s.engine, {"version": 5}))
    assert answer["noop"] is False and "pause" in s.engine.calls


def test_health_and_status_report_the_follower(tmp_path):
    s = Setup(tmp_path)
    s.publish(manifest("r", 4))
    s.poll()
    health = s.control.health()
    assert health["following"] is True
    assert health["follow"]["status"] == "up to date" and health["follow"]["versions_behind"] == 0
    assert health["follow"]["last_poll_at"] <= time.time()
    body = {"method": "deltasync_status"}
    status = asyncio.run(s.control.rpc(s.engine, body))["results"][0]
    assert status["follow"]["served_version"] == 4 and status["follow"]["last_sync"]["version"] == 4
    assert ControlPlane().health()["following"] is False


def test_the_middleware_starts_the_follower_with_the_server_and_stops_it(tmp_path, monkeypatch):
    folder = tmp_path / "bucket"
    store = open_store(str(folder))
    monkeypatch.setenv("DELTASYNC_FOLLOW", "1")
    monkeypatch.setenv("DELTASYNC_FOLLOW_INTERVAL_S", "0.05")
    engine = Engine(str(folder))
    mw = BearerAuthMiddleware(engine, token=TOKEN)
    follower = mw.control.follower
    assert follower.config.interval_s == 0.05

    async def lifespan():
        events = asyncio.Queue()
        await events.put({"type": "lifespan.startup"})
        sent = []

        async def send(message):
            sent.append(message["type"])

        server = asyncio.create_task(mw({"type": "lifespan", "app": engine}, events.get, send))
        engine.bucket_run = "r"
        store.publish(MANIFEST_PATH, manifest("r", 6).to_json())
        for _ in range(200):
            if engine.held == 6:
                break
            await asyncio.sleep(0.02)
        await events.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(server, 10)
        return sent

    sent = asyncio.run(asyncio.wait_for(lifespan(), 30))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert engine.weight_version == "6" and follower._task.done()


def test_settings_are_checked():
    for bad in ({"interval_s": 0}, {"interval_s": float("nan")}, {"jitter": 1.0}):
        with pytest.raises(ValueError):
            FollowConfig(**bad)


def test_jitter_spreads_the_polls(tmp_path):
    s = Setup(tmp_path)
    s.publish(manifest("r", 3))
    delays = [s.poll() for _ in range(50)]
    assert all(0.8 * INTERVAL <= d <= 1.2 * INTERVAL for d in delays)
    assert max(delays) - min(delays) > 0.3 * INTERVAL


def test_logs_name_the_state_not_every_poll(tmp_path, caplog):
    s = Setup(tmp_path)
    s.publish(manifest("r", 3))
    for _ in range(5):
        s.poll()
    assert [r.getMessage() for r in caplog.records] == [
        f"deltasync: follow: polling {s.folder} every 2 s (+-20 %)"
    ]
