"""The trainer's loopback proxy: adds the bearer token to TRL's routes and to nothing else, only
for callers that know its secret path prefix, with its own Host, no Origin and JSON bodies; and it
answers 502 (quietly) while the rollout server is down, e.g. a replica that is restarting.

Every test runs against a real HTTP server on loopback standing in for vLLM, which records each
request that reaches it: a refusal must leave that record empty."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from trainer.auth_proxy import ALLOWED_ROUTES, AuthProxy

TOKEN = "upstream-token"
# One canned reply that satisfies every TRL reader: `VLLMClient.get_max_model_len` and
# `get_dtype`, and the rollout worker's completion parser.
_REPLY = {
    "data": [{"id": "m", "max_model_len": 128}],
    "vllm_config": {"model_config": {"dtype": "torch.bfloat16"}},
    "choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}}],
}


@dataclass
class Seen:
    """One request that reached the stand-in vLLM."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    url: str
    seen: list[Seen] = field(default_factory=list)


class _Recorder(BaseHTTPRequestHandler):
    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self.server.seen.append(  # type: ignore[attr-defined]
            Seen(self.command, self.path, dict(self.headers.items()), body)
        )
        reply = json.dumps(_REPLY).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _record

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Upstream(f"http://127.0.0.1:{server.server_address[1]}", server.seen)  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def proxy(upstream: Upstream) -> Iterator[AuthProxy]:
    with AuthProxy(upstream.url, TOKEN) as p:
        yield p


def _call(
    proxy: AuthProxy,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
    prefix: bool = True,
) -> tuple[int, bytes]:
    """One request to the proxy; `path` goes after the secret prefix unless `prefix` is False."""
    parts = urlsplit(proxy.url)
    target = (parts.path if prefix else "") + path
    sent = {"Host": parts.netloc}
    if body is not None and content_type is not None:
        sent["Content-Type"] = content_type
    sent.update(headers or {})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for key, value in sent.items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_url_carries_a_secret_prefix_that_logs_never_show(
    upstream: Upstream, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="trainer.auth_proxy"):
        with AuthProxy(upstream.url, TOKEN) as a, AuthProxy(upstream.url, TOKEN) as b:
            secret = urlsplit(a.url).path.strip("/")
            _call(a, "POST", "/v1/completions", b"{}")
            _call(a, "POST", "/pause", b"{}")
            _call(a, "POST", "/v1/completions", b"{}", prefix=False)
            _call(a, "POST", f"/{secret[:-1]}/v1/completions", b"{}", prefix=False)
        assert len(secret) >= 32 and "/" not in secret
        assert urlsplit(b.url).path.strip("/") != secret  # one per process (and per proxy)
        assert secret not in a.display_url and secret[:4] in a.display_url
    assert caplog.records, "start and refusals are logged"
    assert not [r for r in caplog.records if secret[:8] in r.getMessage()]


def test_forwards_completions_with_the_token(proxy: AuthProxy, upstream: Upstream):
    status, body = _call(
        proxy,
        "POST",
        "/v1/completions?x=1",
        b'{"prompt": [1]}',
        content_type="application/json; charset=utf-8",
        headers={"Authorization": "Bearer caller-made-up", "X-Forwarded-For": "10.0.0.1"},
    )
    assert status == 200 and json.loads(body) == _REPLY
    [seen] = upstream.seen
    assert (seen.method, seen.path, seen.body) == (
        "POST",
        "/v1/completions?x=1",
        b'{"prompt": [1]}',
    )
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"  # the caller's is replaced
    assert seen.headers["Content-Type"] == "application/json; charset=utf-8"
    assert "X-Forwarded-For" not in seen.headers  # only what the upstream needs is passed on
    assert urlsplit(proxy.url).path.strip("/") not in seen.path


@pytest.mark.parametrize(
    "path", ["/health", "/v1/models", "/server_info?config_format=json"], ids=lambda p: p[:12]
)
def test_forwards_trl_reads_with_the_token(proxy: AuthProxy, upstream: Upstream, path: str):
    status, _ = _call(proxy, "GET", path)
    assert status == 200
    [seen] = upstream.seen
    assert (seen.method, seen.path) == ("GET", path)
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"


def test_trl_clients_keep_the_prefix_and_reach_only_their_routes(
    proxy: AuthProxy, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
):
    """TRL's own code joins `f"{base_url}{route}"`: run it against the proxy's `url`."""
    pytest.importorskip("trl")
    from trl.experimental.async_grpo import vllm_client
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    # TRL logs through accelerate, which needs an initialised Accelerator; a plain logger will do.
    monkeypatch.setattr(vllm_client, "logger", logging.getLogger("trl.test"))
    client = vllm_client.VLLMClient(proxy.url, server_timeout=10)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() == 128
    assert client.get_dtype() == "torch.bfloat16"
    with pytest.raises(Exception, match="403"):
        client.pause()  # TRL's own control calls are refused too (our transport never makes them)

    async def generate() -> dict:
        import aiohttp

        rollout = _AsyncRolloutLoop.__new__(_AsyncRolloutLoop)  # only what `_post` touches
        rollout.vllm_server_url = proxy.url.rstrip("/")
        rollout._counters = {}
        async with aiohttp.ClientSession() as rollout.session:
            return await rollout._post("/v1/completions", {"prompt": [1]}, 30, max_retries=1)

    assert asyncio.run(generate())["choices"] == _REPLY["choices"]
    reached = [(s.method, s.path) for s in upstream.seen]
    assert reached == [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/server_info?config_format=json"),
        ("POST", "/v1/completions"),
    ]
    assert all(s.headers["Authorization"] == f"Bearer {TOKEN}" for s in upstream.seen)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("GET", "/health"),
        ("GET", "/"),
        ("POST", "/not-the-secret/v1/completions"),
        ("POST", "/v1/completions/../../pause"),
    ],
)
def test_no_secret_prefix_is_404_and_nothing_forwarded(
    proxy: AuthProxy, upstream: Upstream, method: str, path: str
):
    status, body = _call(proxy, method, path, b"{}" if method == "POST" else None, prefix=False)
    assert status == 404 and b"not found" in body
    assert upstream.seen == []


def test_a_near_miss_of_the_secret_is_404(proxy: AuthProxy, upstream: Upstream):
    secret = urlsplit(proxy.url).path.strip("/")
    for guess in (secret[:-1], secret + "x", secret.upper(), secret[:4]):
        status, _ = _call(proxy, "GET", f"/{guess}/health", prefix=False)
        assert status == 404, guess
    assert upstream.seen == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("POST", "/collective_rpc"),
        ("POST", "/init_weight_transfer_engine"),
        ("POST", "/start_weight_update"),
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/sleep"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/get_world_size"),
        ("GET", "/metrics"),
        ("GET", "/weight_info"),
        ("GET", ""),
        ("GET", "/"),
        # TRL's routes with the wrong method, or spelled another way
        ("GET", "/v1/completions"),
        ("POST", "/health"),
        ("DELETE", "/v1/models"),
        ("PUT", "/v1/completions"),
        ("OPTIONS", "/v1/completions"),
        ("POST", "/v1/completions/"),
        ("POST", "/v1//completions"),
        ("POST", "/v1/%63ompletions"),
        ("POST", "/v1/completions/../../pause"),
        ("POST", "/./pause"),
    ],
)
def test_routes_trl_does_not_call_are_refused(
    proxy: AuthProxy,
    upstream: Upstream,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
):
    body = b"{}" if method in ("POST", "PUT") else None
    with caplog.at_level(logging.WARNING, logger="trainer.auth_proxy"):
        status, _ = _call(proxy, method, path, body)
    assert status == 403
    assert upstream.seen == []
    [line] = [r for r in caplog.records if r.name == "trainer.auth_proxy"]
    assert "refused" in line.getMessage() and "403" in line.getMessage()


@pytest.mark.parametrize(
    "host", ["evil.example", "localhost:{port}", "127.0.0.1", "127.0.0.1:1", "[::1]:{port}", ""]
)
def test_a_foreign_host_is_refused(proxy: AuthProxy, upstream: Upstream, host: str):
    """DNS rebinding: a page on another name that resolves to 127.0.0.1 sends its own Host."""
    host = host.format(port=urlsplit(proxy.url).port)
    status, _ = _call(proxy, "POST", "/v1/completions", b"{}", headers={"Host": host})
    assert status == 403
    assert upstream.seen == []


def test_a_request_with_an_origin_is_refused(proxy: AuthProxy, upstream: Upstream):
    """TRL sends no Origin; a browser sends one with every cross-origin POST."""
    origin = {"Origin": "http://evil.example"}
    assert _call(proxy, "POST", "/v1/completions", b"{}", headers=origin)[0] == 403
    assert _call(proxy, "GET", "/v1/models", headers={"Origin": "null"})[0] == 403
    assert upstream.seen == []


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        None,
    ],
)
def test_a_non_json_post_is_415(proxy: AuthProxy, upstream: Upstream, content_type: str | None):
    """The content types a cross-site form can send without a CORS preflight, and none at all."""
    status, _ = _call(
        proxy, "POST", "/v1/completions", b'{"prompt": [1]}', content_type=content_type
    )
    assert status == 415
    assert upstream.seen == []


def test_allowed_routes_are_exactly_trls():
    """Widening the list is a security decision: it must change this test too."""
    trls = {
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/server_info"),
        ("GET", "/health"),
    }
    assert trls == ALLOWED_ROUTES


def test_upstream_down_is_a_quiet_502(caplog: pytest.LogCaptureFixture):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.ERROR), AuthProxy(f"http://127.0.0.1:{port}", TOKEN) as proxy:
        status, body = _call(proxy, "POST", "/v1/completions", b"{}")
    assert status == 502 and b"unreachable" in body and TOKEN.encode() not in body
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")]
