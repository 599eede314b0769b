"""The auth middleware: deny by default, constant-time compare, the route policy (403), bounded
bodies, the bootstrap gate, and `/health` with the pause state (stand-in app, no server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from deltasync.vllm_ext.server.auth import ROUTES, BearerAuthMiddleware, LoopbackMiddleware

TOKEN = "s3cret-token"
AUTH = f"Bearer {TOKEN}"


class App:
    """A stand-in ASGI app with vLLM's `state.engine_client.get_weight_version()`."""

    def __init__(self, version: str = "default"):
        self.calls: list[str] = []
        self.bodies: list[bytes] = []
        self.version = version
        self.state = self

    @property
    def engine_client(self):
        return self

    async def get_weight_version(self) -> str:
        return self.version

    async def __call__(self, scope, receive, send):
        self.calls.append(scope["path"])
        if scope["method"] not in ("GET", "HEAD"):
            self.bodies.append((await receive()).get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(mw, app, path, *, auth=None, method="POST", kind="http", body=b"", client="127.0.0.1"):
    """One request through the middleware; returns what it sent."""
    headers = [(b"host", b"x")]
    if auth is not None:
        headers.append((b"authorization", auth.encode()))
    scope = {
        "type": kind,
        "path": path,
        "method": method,
        "headers": headers,
        "app": app,
        "client": (client, 5000),
    }
    sent = []

    async def receive():
        if kind == "websocket":
            return {"type": "websocket.connect"}
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent


def status(sent) -> int:
    return sent[0]["status"]


def answer(sent):
    return json.loads(sent[1]["body"])


ALLOWED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/weight_info"),
    ("GET", "/metrics"),
    ("GET", "/server_info"),
]
DENIED = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/update_weight_version"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/invocations"),
    ("POST", "/weight_checker"),
    ("GET", "/docs"),
    ("GET", "/anything"),
    ("POST", "/v1/models"),
    ("POST", "/pause/"),
    ("POST", "//pause"),
]


@pytest.mark.parametrize(("method", "path"), ALLOWED + DENIED + [("POST", "/deltasync/sync")])
def test_every_route_needs_the_token(method, path):
    app = App("3")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    for auth in (None, "", "Bearer", "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"):
        sent = call(mw, app, path, auth=auth, method=method)
        assert status(sent) == 401
        assert answer(sent) == {"error": "missing or wrong bearer token"}
    assert app.calls == []


@pytest.mark.parametrize(("method", "path"), ALLOWED)
def test_generation_and_info_routes_pass_with_the_token(method, path):
    app = App("3")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    assert status(call(mw, app, path, auth=AUTH, method=method, body=b'{"a": 1}')) == 200
    assert status(call(mw, app, path, auth=f"bearer {TOKEN}", method=method)) == 200
    assert app.calls == [path, path]
    if method == "POST":
        assert app.bodies[0] == b'{"a": 1}'  # the body read for its bound reaches the app


@pytest.mark.parametrize(("method", "path"), DENIED)
def test_other_routes_are_403_even_with_the_token(method, path, caplog):
    app = App("3")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    sent = call(mw, app, path, auth=AUTH, method=method)
    assert status(sent) == 403
    assert "not a route of this server" in answer(sent)["error"]
    assert app.calls == []
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_the_route_table_names_no_weight_changing_vllm_route():
    changing = {"/pause", "/resume", "/update_weights", "/start_weight_update", "/sleep"}
    changing |= {"/finish_weight_update", "/update_weight_version", "/wake_up"}
    assert not {path for _, path in ROUTES} & changing


def test_health_is_open_but_only_for_reading():
    app = App()
    mw = BearerAuthMiddleware(app, token=TOKEN, gate=True)
    sent = call(mw, app, "/health", method="GET")
    assert status(sent) == 200
    assert answer(sent) == {
        "status": "ok",
        "version": None,  # nothing synced yet
        "last_pause_s": None,
        "paused": False,
        "pause_deadline_s": 90.0,
        "pauses_expired": 0,
        "following": False,
    }
    assert status(call(mw, app, "/health", method="HEAD")) == 200
    assert status(call(mw, app, "/health", method="POST")) == 401


def test_websockets_are_closed_without_the_token_and_off_the_route_table():
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    closed = [{"type": "websocket.close", "code": 1008}]
    assert call(mw, app, "/v1/realtime", kind="websocket") == closed
    assert call(mw, app, "/v1/realtime", kind="websocket", auth=AUTH) == closed
    assert app.calls == []


def test_request_bodies_are_bounded():
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    big = b"x" * (64 * 1024 + 1)
    assert status(call(mw, app, "/deltasync/sync", auth=AUTH, body=big)) == 413
    assert status(call(mw, app, "/v1/completions", auth=AUTH, body=b"x" * (33 << 20))) == 413
    assert app.calls == []


def test_gate_holds_traffic_until_a_version_is_recorded():
    app = App("default")
    mw = BearerAuthMiddleware(app, token=TOKEN, gate=True)
    assert status(call(mw, app, "/v1/completions", auth=AUTH)) == 503
    assert status(call(mw, app, "/weight_info", auth=AUTH, method="GET")) == 200  # info
    app.version = "15"
    assert status(call(mw, app, "/v1/completions", auth=AUTH)) == 200
    app.version = "default"  # once serving, it stays open (no per-request engine call)
    assert status(call(mw, app, "/v1/completions", auth=AUTH)) == 200


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("DELTASYNC_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="DELTASYNC_API_KEY"):
        BearerAuthMiddleware(App())
    monkeypatch.setenv("DELTASYNC_API_KEY", TOKEN)
    monkeypatch.setenv("DELTASYNC_GATE", "1")
    monkeypatch.setenv("DELTASYNC_PAUSE_DEADLINE_S", "2.5")
    mw = BearerAuthMiddleware(App())
    assert mw.gate and status(call(mw, App(), "/v1/completions", auth=AUTH)) == 503
    assert mw.control.config.pause_deadline_s == 2.5
    monkeypatch.setenv("DELTASYNC_PAUSE_DEADLINE_S", "-1")
    with pytest.raises(RuntimeError, match="DELTASYNC_PAUSE_DEADLINE_S"):
        BearerAuthMiddleware(App())


def test_dev_routes_answer_loopback_clients_only():
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN, dev_routes=True)
    assert status(call(mw, app, "/pause", auth=AUTH)) == 200
    assert status(call(mw, app, "/pause", auth=AUTH, client="10.0.0.7")) == 403
    assert app.calls == ["/pause"]


def test_the_loopback_middleware_needs_no_token_but_a_loopback_client():
    app = App("1")
    mw = LoopbackMiddleware(app)
    assert status(call(mw, app, "/v1/completions")) == 200
    assert status(call(mw, app, "/v1/completions", client="::1")) == 200
    assert status(call(mw, app, "/v1/completions", client="192.168.1.2")) == 401
    assert status(call(mw, app, "/pause")) == 403


def test_a_refused_path_stays_on_one_log_line(caplog):
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    sent = call(mw, app, "/x\nINFO 12-02 forged line", auth=AUTH)
    assert status(sent) == 403
    (record,) = [r for r in caplog.records if r.name.startswith("deltasync")]
    assert "\n" not in record.getMessage() and "\\n" in record.getMessage()
