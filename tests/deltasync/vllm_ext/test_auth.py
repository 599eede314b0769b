"""The auth middleware: deny by default, constant-time compare, the route policy (403), bounded
bodies, the bootstrap gate, and `/health` with the pause state (stand-in app, no server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from deltasync.settings import SettingError
from deltasync.vllm_ext.server.app import ROUTES, BearerAuthMiddleware, LoopbackMiddleware

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


def call(
    mw,
    app,
    path,
    *,
    auth=None,
    method="POST",
    kind="http",
    body=b"",
    client="127.0.0.1",
    host="127.0.0.1:8001",
    headers=(),
):
    """One request through the middleware (a POST says its body is JSON unless `headers` give
    a content type); returns what it sent."""
    given = {k.lower() for k, _ in headers}
    headers = [(b"host", host.encode()), *((k.encode(), v.encode()) for k, v in headers)]
    if method == "POST" and "content-type" not in given:
        headers.append((b"content-type", b"application/json"))
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
    with pytest.raises(SettingError, match="DELTASYNC_PAUSE_DEADLINE_S"):
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


BROWSER_SHAPED = [
    ({"host": "evil.test:8001"}, "Host is not a loopback address"),  # DNS rebinding
    ({"host": "127.0.0.1.evil.test"}, "Host is not a loopback address"),
    ({"host": ""}, "Host is not a loopback address"),
    ({"headers": (("Origin", "http://evil.test"),)}, "Origin"),
    ({"headers": (("Origin", "null"),)}, "Origin"),
    ({"headers": (("Content-Type", "text/plain"),)}, "application/json"),  # CORS simple
    ({"headers": (("Content-Type", "application/x-www-form-urlencoded"),)}, "application/json"),
    ({"headers": (("Content-Type", "multipart/form-data; boundary=x"),)}, "application/json"),
]


@pytest.mark.parametrize("path", ["/deltasync/sync", "/collective_rpc", "/v1/completions"])
@pytest.mark.parametrize(("shape", "phrase"), BROWSER_SHAPED)
def test_without_a_token_browser_shaped_requests_are_refused(path, shape, phrase):
    """A web page on the same machine is a loopback client: without auth, what only a browser
    sends is 403 before anything is read or forwarded."""
    app = App("1")
    sent = call(LoopbackMiddleware(app), app, path, body=b"{}", **shape)
    assert status(sent) == 403 and phrase in answer(sent)["error"]
    assert app.calls == []


@pytest.mark.parametrize("host", ["127.0.0.1:8001", "localhost:18001", "[::1]:8001", "127.0.0.2"])
def test_without_a_token_a_port_forwarded_loopback_host_still_works(host):
    app = App("1")
    assert status(call(LoopbackMiddleware(app), app, "/v1/completions", host=host)) == 200
    assert status(call(LoopbackMiddleware(app), app, "/health", method="GET", host=host)) == 200


def test_with_a_token_the_host_and_origin_are_not_checked():
    """A Space is reached through the Hub's proxy under its own name; the token is the guard."""
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    sent = call(mw, app, "/v1/completions", auth=AUTH, host="alice-vllm-0.hf.space")
    assert status(sent) == 200


def test_a_refused_path_stays_on_one_log_line(caplog):
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN)
    sent = call(mw, app, "/x\nINFO 12-02 forged line", auth=AUTH)
    assert status(sent) == 403
    (record,) = [r for r in caplog.records if r.name.startswith("deltasync")]
    assert "\n" not in record.getMessage() and "\\n" in record.getMessage()


@pytest.mark.parametrize("dev_routes", [False, True])
@pytest.mark.parametrize("method", [["deltasync_status"], {"a": 1}, 7, None])
def test_a_non_string_rpc_method_is_a_422_on_one_warning_line(caplog, dev_routes, method):
    app = App("1")
    mw = BearerAuthMiddleware(app, token=TOKEN, dev_routes=dev_routes)
    body = json.dumps({"method": method}).encode()
    with caplog.at_level("INFO", logger="deltasync"):
        sent = call(mw, app, "/collective_rpc", auth=AUTH, body=body)
    assert (status(sent), answer(sent)) == (422, {"error": "method must be a string"})
    (record,) = [r for r in caplog.records if "collective_rpc" in r.getMessage()]
    assert record.levelname == "WARNING" and app.calls == []
