"""The trainer's loopback proxy: adds the bearer token to TRL's routes and to nothing else, only
for callers that know its secret path prefix, with its own Host, no Origin and JSON bodies; and it
answers 502 (quietly) while the rollout server is down, e.g. a replica that is restarting.

Every test runs against real HTTP servers on loopback standing in for vLLM, which record each
request that reaches them: a refusal must leave every record empty. The proxy fixture runs each
test over one replica (as before routing) and over three (`proxy.router` spreads requests; where
they go is tested in test_routing.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from loopback_upstream import REPLY, Upstream, call, seen_by

from trainer.auth_proxy import ALLOWED_ROUTES, AuthProxy

TOKEN = "upstream-token"
# The stand-ins record every request: no /health probes here (they are tested on their own).
_proxy = functools.partial(AuthProxy, dead_after_s=None)


@pytest.fixture(params=[1, 3], ids=["1-replica", "3-replicas"])
def fleet(request: pytest.FixtureRequest) -> Iterator[list[Upstream]]:
    upstreams = [Upstream().start() for _ in range(request.param)]
    try:
        yield upstreams
    finally:
        for upstream in upstreams:
            upstream.stop()


@pytest.fixture
def proxy(fleet: list[Upstream]) -> Iterator[AuthProxy]:
    with _proxy([u.url for u in fleet], TOKEN) as p:
        yield p


def _call(proxy: AuthProxy, method: str, path: str, body: bytes | None = None, **kw) -> tuple:
    """One request to the proxy; `path` goes after the secret prefix unless `prefix=False`."""
    return call(proxy.url, method, path, body, **kw)


def test_url_carries_a_secret_prefix_that_logs_never_show(
    fleet: list[Upstream], caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO):  # the proxy's and the router's lines
        urls = [u.url for u in fleet]
        with _proxy(urls, TOKEN) as a, _proxy(urls, TOKEN) as b:
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


def test_forwards_completions_with_the_token(proxy: AuthProxy, fleet: list[Upstream]):
    status, body = _call(
        proxy,
        "POST",
        "/v1/completions?x=1",
        b'{"prompt": [1]}',
        content_type="application/json; charset=utf-8",
        headers={"Authorization": "Bearer caller-made-up", "X-Forwarded-For": "10.0.0.1"},
    )
    assert status == 200 and json.loads(body) == REPLY
    [seen] = seen_by(fleet)
    assert (seen.method, seen.path, seen.body) == (
        "POST",
        "/v1/completions?x=1",
        b'{"prompt": [1]}',
    )
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"  # the caller's is replaced
    assert seen.headers["Content-Type"] == "application/json; charset=utf-8"
    assert "X-Forwarded-For" not in seen.headers  # only what the upstream needs is passed on
    assert urlsplit(proxy.url).path.strip("/") not in seen.path


def test_without_a_token_no_authorization_is_sent(fleet: list[Upstream]):
    """Unauthenticated local replicas: the proxy still routes, and adds no header."""
    with _proxy([u.url for u in fleet], None) as proxy:
        status, _ = _call(
            proxy, "POST", "/v1/completions", b"{}", headers={"Authorization": "Bearer mine"}
        )
    assert status == 200
    [seen] = seen_by(fleet)
    assert "Authorization" not in seen.headers


@pytest.mark.parametrize(
    "path", ["/health", "/v1/models", "/server_info?config_format=json"], ids=lambda p: p[:12]
)
def test_forwards_trl_reads_with_the_token(proxy: AuthProxy, fleet: list[Upstream], path: str):
    status, _ = _call(proxy, "GET", path)
    assert status == 200
    [seen] = seen_by(fleet)
    assert (seen.method, seen.path) == ("GET", path)
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"


def test_trl_clients_keep_the_prefix_and_reach_only_their_routes(
    proxy: AuthProxy, fleet: list[Upstream], monkeypatch: pytest.MonkeyPatch
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

    assert asyncio.run(generate())["choices"] == REPLY["choices"]
    reached = [(s.method, s.path) for s in seen_by(fleet)]
    assert reached == [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/server_info?config_format=json"),
        ("POST", "/v1/completions"),
    ]
    assert all(s.headers["Authorization"] == f"Bearer {TOKEN}" for s in seen_by(fleet))


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
    proxy: AuthProxy, fleet: list[Upstream], method: str, path: str
):
    status, body = _call(proxy, method, path, b"{}" if method == "POST" else None, prefix=False)
    assert status == 404 and b"not found" in body
    assert seen_by(fleet) == []


def test_a_near_miss_of_the_secret_is_404(proxy: AuthProxy, fleet: list[Upstream]):
    secret = urlsplit(proxy.url).path.strip("/")
    for guess in (secret[:-1], secret + "x", secret.upper(), secret[:4]):
        status, _ = _call(proxy, "GET", f"/{guess}/health", prefix=False)
        assert status == 404, guess
    assert seen_by(fleet) == []


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
    fleet: list[Upstream],
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
):
    body = b"{}" if method in ("POST", "PUT") else None
    with caplog.at_level(logging.WARNING, logger="trainer.auth_proxy"):
        status, _ = _call(proxy, method, path, body)
    assert status == 403
    assert seen_by(fleet) == []
    [line] = [r for r in caplog.records if r.name == "trainer.auth_proxy"]
    assert "refused" in line.getMessage() and "403" in line.getMessage()


@pytest.mark.parametrize(
    "host", ["evil.example", "localhost:{port}", "127.0.0.1", "127.0.0.1:1", "[::1]:{port}", ""]
)
def test_a_foreign_host_is_refused(proxy: AuthProxy, fleet: list[Upstream], host: str):
    """DNS rebinding: a page on another name that resolves to 127.0.0.1 sends its own Host."""
    host = host.format(port=urlsplit(proxy.url).port)
    status, _ = _call(proxy, "POST", "/v1/completions", b"{}", headers={"Host": host})
    assert status == 403
    assert seen_by(fleet) == []


def test_a_request_with_an_origin_is_refused(proxy: AuthProxy, fleet: list[Upstream]):
    """TRL sends no Origin; a browser sends one with every cross-origin POST."""
    origin = {"Origin": "http://evil.example"}
    assert _call(proxy, "POST", "/v1/completions", b"{}", headers=origin)[0] == 403
    assert _call(proxy, "GET", "/v1/models", headers={"Origin": "null"})[0] == 403
    assert seen_by(fleet) == []


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
def test_a_non_json_post_is_415(proxy: AuthProxy, fleet: list[Upstream], content_type: str | None):
    """The content types a cross-site form can send without a CORS preflight, and none at all."""
    status, _ = _call(
        proxy, "POST", "/v1/completions", b'{"prompt": [1]}', content_type=content_type
    )
    assert status == 415
    assert seen_by(fleet) == []


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
    with caplog.at_level(logging.ERROR), AuthProxy([f"http://127.0.0.1:{port}"], TOKEN) as proxy:
        status, body = _call(proxy, "POST", "/v1/completions", b"{}")
    assert status == 502 and b"unreachable" in body and TOKEN.encode() not in body
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")]


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /%s\x00 HTTP/1.1\r\n\r\n",  # most of the secret, then a byte no URL may hold
]


def test_malformed_requests_are_one_log_line_each(caplog: pytest.LogCaptureFixture):
    """Any local process can send bytes that are not HTTP: each is a 400 and one warning line
    (no traceback, nothing of the request), so the trainer's log cannot be flooded."""
    with caplog.at_level(logging.DEBUG), AuthProxy(["http://127.0.0.1:9"], TOKEN) as proxy:
        address = urlsplit(proxy.url)
        secret = address.path.strip("/")
        for raw in MALFORMED:
            raw = raw.replace(b"%s", secret[:-1].encode()) if b"%s" in raw else raw
            with socket.create_connection((address.hostname, address.port), timeout=10) as s:
                s.sendall(raw)
                assert s.recv(64).startswith(b"HTTP/1.0 400")
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == len(MALFORMED)
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in lines)
    assert all("\n" not in r.getMessage() and secret[:8] not in r.getMessage() for r in lines)
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")]
