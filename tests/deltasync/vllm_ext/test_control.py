"""The control plane behind the middleware, against a stand-in engine client (no server): the sync
route's order of calls, strict bodies, typed errors, the whitelist of RPCs, the bucket init, and
a pause that ends by itself."""

from __future__ import annotations

import asyncio
import json

import pytest
from standin_engine import StandInEngine

from deltasync.vllm_ext.server.app import BearerAuthMiddleware
from deltasync.vllm_ext.server.control import ControlConfig, ControlPlane

TOKEN = "s3cret-token"


class Engine(StandInEngine):
    """vLLM's `AsyncLLM` as the control plane uses it, with one worker holding `held`."""

    def __init__(self):
        self.weight_version = "3"
        self.held = 3
        self.paused = False
        self.calls: list[str] = []
        self.staging: dict[str, str] = {}
        self.stage_error: str | None = None
        self.apply_error: tuple[str, str] | None = None
        self.pause_stall_s = 0.0
        self.bucket = "/b"

    async def __call__(self, scope, receive, send):  # vLLM's own routes: /health here
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append(f"pause {mode}")
        self.paused = True
        await asyncio.sleep(self.pause_stall_s)

    async def resume_generation(self):
        self.calls.append("resume")
        self.paused = False

    async def reset_prefix_cache(self, *args):
        self.calls.append("reset_prefix_cache")
        return True

    def status(self):
        return {
            "bucket": self.bucket,
            "run_id": "r",
            "version": self.held,
            "state_digest": f"d{self.held}",
            "staging": dict(self.staging),
            "busy": False,
            "last_update": {"bytes": 10, "files": ["f"], "swapped": True, "commit_s": 0.01},
        }

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        kwargs = kwargs or {}
        if method == "deltasync_stage":
            error = self.stage_error
            self.staging[kwargs["version"]] = f"failed: {error}" if error else "ready"
        elif method == "deltasync_apply":
            if self.apply_error:
                kind, message = self.apply_error
                return [self.status() | {"error": f"{kind}: {message}", "error_type": kind}]
            self.held = int(kwargs["version"])
            return [self.status() | {"error": None, "error_type": None}]
        elif method == "deltasync_init":
            info = kwargs["init_info"]
            refused = None if info["bucket"] == self.bucket else "follows /b"
            return [{"refused": refused, "bucket": self.bucket}]
        elif method not in ("deltasync_status", "deltasync_digests", "deltasync_state_share"):
            raise AssertionError(f"the control plane called {method}")
        return [self.status()]


def middleware(engine: Engine, **config) -> BearerAuthMiddleware:
    return BearerAuthMiddleware(engine, token=TOKEN, control=ControlPlane(ControlConfig(**config)))


async def request(mw, engine, path, body=None, *, method="POST", raw=None):
    """One request through the middleware; (status, decoded JSON answer)."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    scope = {
        "type": "http",
        "path": path,
        "method": method,
        "headers": headers,
        "app": engine,
        "client": ("127.0.0.1", 1),
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message):
        sent.append(message)

    await mw(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_one_request_stages_pauses_applies_records_and_resumes():
    engine = Engine()
    mw = middleware(engine)
    code, answer = run(request(mw, engine, "/deltasync/sync", {"version": 4, "path": "runs/r/x"}))
    assert code == 200, answer
    assert engine.calls == [
        "deltasync_status",
        "deltasync_stage",
        "pause keep",
        "deltasync_apply",
        "record 4",
        "reset_prefix_cache",
        "resume",
    ]
    assert engine.weight_version == "4" and not engine.paused
    assert answer["version"] == 4 and answer["previous_version"] == "3"
    assert answer["bytes"] == 10 and answer["pause_s"] >= 0 and answer["pause_expired"] is False


@pytest.mark.parametrize(
    "body",
    [
        {"version": "4"},
        {"version": 4.0},
        {"version": True},
        {"version": 0},
        {"version": 2**63},
        {"version": "٢"},
        {"version": "²"},
        {"version": 4, "weight_version": "999"},
        {"version": 4, "path": ["x"]},
        {"version": 4, "path": "../manifest.json"},
        {"path": "runs/r/x"},
        [4],
    ],
)
def test_a_malformed_sync_request_is_a_422_and_changes_nothing(body, caplog):
    engine = Engine()
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", body))
    assert code == 422 and "\n" not in answer["error"], answer
    assert engine.calls == [] and engine.weight_version == "3"
    lines = [r for r in caplog.records if r.name.startswith("deltasync")]
    assert len(lines) == 1 and "answered 422" in lines[0].getMessage()


def test_a_body_that_is_not_json_is_a_400():
    engine = Engine()
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", raw=b"{version"))
    assert code == 400 and answer == {"error": "the body is not JSON"} and engine.calls == []


def test_a_sync_before_the_bucket_init_is_a_409():
    engine = Engine()
    engine.bucket = None
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", {"version": 4}))
    assert code == 409 and "init_weight_transfer_engine" in answer["error"]
    assert engine.calls == ["deltasync_status"]


def test_a_failed_staging_is_refused_before_any_pause():
    engine = Engine()
    engine.stage_error = "ChainError: version 9 is not in the bucket yet (latest 4)"
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", {"version": 9}))
    assert code == 409 and "not in the bucket yet" in answer["error"]
    assert "pause keep" not in engine.calls and engine.weight_version == "3"


@pytest.mark.parametrize("evictions", [1, 3, 99])
def test_a_slot_evicted_by_other_staging_calls_is_submitted_again(evictions):
    engine = Engine()
    stage = engine.collective_rpc
    seen = {"stage": 0, "busy": 2}

    async def evicting(method, timeout=None, args=(), kwargs=None):
        results = await stage(method, timeout, args, kwargs)
        if method == "deltasync_stage":
            seen["stage"] += 1
            if seen["stage"] <= evictions:
                engine.staging.clear()  # others' staging calls pushed this one out
                return [engine.status()]
        if method != "deltasync_apply" and seen["busy"] and "4" in engine.staging:
            seen["busy"] -= 1  # another staging still runs: the pause waits for it
            return [results[0] | {"busy": True}]
        return results

    engine.collective_rpc = evicting
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", {"version": 4}))
    if evictions < 4:
        assert code == 200 and engine.weight_version == "4"
        assert engine.calls.count("deltasync_stage") == evictions + 1 and seen["busy"] == 0
    else:
        assert code == 503 and "keep evicting" in answer["error"]
        assert "pause keep" not in engine.calls and engine.weight_version == "3"


def test_a_refused_apply_resumes_and_keeps_the_version():
    engine = Engine()
    engine.apply_error = ("DigestMismatch", "digest mismatch for tensor 'w'; nothing was applied")
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", {"version": 4}))
    assert code == 409 and "digest mismatch" in answer["error"]
    assert answer["served_version"] == "3"
    assert engine.calls[-1] == "resume" and not engine.paused
    assert engine.weight_version == "3" and not any(c.startswith("record") for c in engine.calls)


def test_the_recorded_version_is_the_one_the_workers_verified():
    engine = Engine()

    async def apply_another(method, timeout=None, args=(), kwargs=None):
        if method == "deltasync_apply":
            engine.held = 5  # a worker that ended elsewhere than asked
            return [engine.status() | {"error": None, "error_type": None}]
        return await Engine.collective_rpc(engine, method, timeout, args, kwargs)

    engine.collective_rpc = apply_another
    code, answer = run(request(middleware(engine), engine, "/deltasync/sync", {"version": 4}))
    assert code == 500 and "report version 5" in answer["error"]
    assert engine.weight_version == "3" and not engine.paused


def test_a_pause_ends_by_itself_and_health_reports_it(caplog):
    """The sync is stuck inside its pause past the deadline: the watchdog resumes generation
    (one log line), /health stays 200 and says so, and the sync gives up without applying."""
    engine = Engine()
    engine.pause_stall_s = 3.0  # margins of 0.7 s and more around the 1 s deadline
    mw = middleware(engine, pause_deadline_s=1.0)

    async def scenario():
        sync = asyncio.create_task(request(mw, engine, "/deltasync/sync", {"version": 4}))
        await asyncio.sleep(0.3)
        during = await request(mw, engine, "/health", method="GET")
        await asyncio.sleep(1.5)
        after = await request(mw, engine, "/health", method="GET")
        resumed_alone = not engine.paused
        return await sync, during, after, resumed_alone

    (code, answer), during, after, resumed_alone = run(scenario())
    assert during[0] == 200 and during[1]["paused"] is True and during[1]["syncing_version"] == 4
    assert after[0] == 200 and after[1]["paused"] is False and after[1]["pauses_expired"] == 1
    assert resumed_alone
    assert (
        code == 503 and "deadline" in answer["error"] and "nothing was applied" in answer["error"]
    )
    assert "deltasync_apply" not in engine.calls and engine.weight_version == "3"
    assert engine.calls.count("resume") == 1
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("deltasync")]
    assert len(lines) == 2  # the watchdog's, and the sync's answer
    assert "the pause for version 4 passed its 1 s deadline: resuming generation" in lines[0]
    assert "answered 503" in lines[1]


def test_syncs_are_serialised():
    engine = Engine()
    engine.pause_stall_s = 0.1
    mw = middleware(engine)

    async def two():
        return await asyncio.gather(
            request(mw, engine, "/deltasync/sync", {"version": 4}),
            request(mw, engine, "/deltasync/sync", {"version": 5}),
        )

    assert [code for code, _ in run(two())] == [200, 200]
    pauses = [c for c in engine.calls if c in ("pause keep", "resume")]
    assert pauses == ["pause keep", "resume", "pause keep", "resume"]
    assert engine.weight_version == "5"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"method": "save_sharded_state", "kwargs": {"path": "/tmp/x"}}, 403),
        ({"method": "init_weight_transfer_engine", "kwargs": {}}, 403),
        ({"method": "deltasync_apply", "kwargs": {"version": "4"}}, 403),
        ({"method": "deltasync_init", "kwargs": {}}, 403),
        ({"method": "reload_weights"}, 403),
        ({"method": "deltasync_stage", "kwargs": {"version": "4", "path": ["x"]}}, 422),
        ({"method": "deltasync_stage", "kwargs": {"version": "٢"}}, 422),
        ({"method": "deltasync_stage", "kwargs": {"version": "²"}}, 422),
        ({"method": "deltasync_stage", "kwargs": {"version": 4}}, 422),
        ({"method": "deltasync_stage", "kwargs": {"version": "4", "x": "1"}}, 422),
        ({"method": "deltasync_stage", "args": ["4"]}, 422),
        ({"method": "deltasync_status", "kwargs": {"a": "b"}}, 422),
        ({"method": "deltasync_status", "timeout": 1}, 422),
    ],
)
def test_only_whitelisted_rpcs_with_checked_arguments_reach_the_workers(body, code):
    engine = Engine()
    status, answer = run(request(middleware(engine), engine, "/collective_rpc", body))
    assert status == code and "\n" not in answer["error"], answer
    assert engine.calls == []


def test_whitelisted_rpcs_answer_like_vllm():
    engine = Engine()
    mw = middleware(engine)
    body = {"method": "deltasync_stage", "kwargs": {"version": "4", "path": "runs/r/x"}}
    code, answer = run(request(mw, engine, "/collective_rpc", body))
    assert code == 200 and answer["results"][0]["staging"] == {"4": "ready"}
    code, answer = run(request(mw, engine, "/collective_rpc", {"method": "deltasync_status"}))
    assert code == 200 and answer["results"][0]["version"] == 3


def test_init_refuses_another_bucket():
    engine = Engine()
    mw = middleware(engine)
    code, answer = run(
        request(mw, engine, "/init_weight_transfer_engine", {"init_info": {"bucket": "/c"}})
    )
    assert code == 403 and answer == {"error": "follows /b"}
    ok = {"init_info": {"bucket": "/b", "prepack": False}}
    assert run(request(mw, engine, "/init_weight_transfer_engine", ok))[0] == 200
    for bad in ({"init_info": {"bucket": "/b", "token": "x"}}, {"bucket": "/b"}, []):
        assert run(request(mw, engine, "/init_weight_transfer_engine", bad))[0] == 422


def test_a_call_in_flight_when_the_engine_dies_is_a_503():
    """vLLM never answers an RPC that was in flight when its engine died (its pending utility
    futures are never resolved): the call sees `errored` and answers 503 instead of hanging."""

    class Dying(Engine):
        errored = False

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.errored = True
            await asyncio.Event().wait()  # never answered

    engine = Dying()
    status, answer = run(
        request(middleware(engine), engine, "/collective_rpc", {"method": "deltasync_status"})
    )
    assert (status, answer) == (503, {"error": "deltasync_status failed: the engine died"})
