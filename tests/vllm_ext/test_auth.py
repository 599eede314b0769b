"""The bearer-token middleware: deny by default, constant-time compare, the bootstrap gate."""

from __future__ import annotations

import asyncio
import json

import pytest

from deltasync.vllm_ext.auth import BearerAuthMiddleware

TOKEN = "s3cret-token"


class App:
    """A stand-in ASGI app with vLLM's `state.engine_client.get_weight_version()`."""

    def __init__(self, version: str = "default"):
        self.calls: list[str] = []
        self.version = version
        self.state = self

    @property
    def engine_client(self):
        return self

    async def get_weight_version(self) -> str:
        return self.version

    async def __call__(self, scope, receive, send):
        self.calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _call(mw, app, path, *, auth=None, method="POST", kind="http"):
    headers = [(b"host", b"x")]
    if auth is not None:
        headers.append((b"authorization", auth.encode()))
    scope = {"type": kind, "path": path, "method": method, "headers": headers, "app": app}
    sent = []

    async def receive():
        return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request"}

    async def send(message):
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent


def _status(sent) -> int:
    return sent[0]["status"]


@pytest.mark.parametrize(
    "path",
    [
        "/pause",
        "/update_weights",
        "/collective_rpc",
        "/v1/completions",
        "/invocations",
        "/metrics",
        "/weight_info",
        "/docs",
        "/sleep",
        "/scale_elastic_ep",
        "/anything",
    ],
)
def test_every_route_needs_the_token(path):
    app = App("3")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    for auth in (None, "", "Bearer", "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"):
        sent = _call(mw, app, path, auth=auth)
        assert _status(sent) == 401
        assert json.loads(sent[1]["body"]) == {"error": "missing or wrong bearer token"}
    assert app.calls == []
    assert _status(_call(mw, app, path, auth=f"Bearer {TOKEN}")) == 200
    assert _status(_call(mw, app, path, auth=f"bearer {TOKEN}", method="GET")) == 200
    assert app.calls == [path, path]


def test_health_is_open_but_only_for_reading():
    app = App()
    mw = BearerAuthMiddleware(app, token=TOKEN, gate=True)
    assert _status(_call(mw, app, "/health", method="GET")) == 200
    assert _status(_call(mw, app, "/health", method="POST")) == 401


def test_websockets_are_closed_without_the_token():
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    assert _call(mw, app, "/v1/realtime", kind="websocket") == [
        {"type": "websocket.close", "code": 1008}
    ]
    assert app.calls == []


def test_gate_holds_traffic_until_a_version_is_recorded():
    app = App("default")
    mw = BearerAuthMiddleware(app, token=TOKEN, gate=True)
    auth = f"Bearer {TOKEN}"
    assert _status(_call(mw, app, "/v1/completions", auth=auth)) == 503
    assert _status(_call(mw, app, "/update_weights", auth=auth)) == 200  # control route
    app.version = "15"
    assert _status(_call(mw, app, "/v1/completions", auth=auth)) == 200
    app.version = "default"  # once serving, it stays open (no per-request engine call)
    assert _status(_call(mw, app, "/v1/completions", auth=auth)) == 200


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("DELTASYNC_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="DELTASYNC_API_KEY"):
        BearerAuthMiddleware(App())
    monkeypatch.setenv("DELTASYNC_API_KEY", TOKEN)
    monkeypatch.setenv("DELTASYNC_GATE", "1")
    mw = BearerAuthMiddleware(App())
    assert mw.gate and _status(_call(mw, App(), "/x", auth=f"Bearer {TOKEN}")) == 503
