"""Stand-in rollout servers for the trainer's proxy tests (`from loopback_upstream import ...`):
real HTTP servers on loopback that record every request reaching them, and can be told to answer
an error status, to hold requests until released, or to go away and come back on their port."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# One canned reply that satisfies every TRL reader: `VLLMClient.get_max_model_len` and
# `get_dtype`, and the rollout worker's completion parser.
REPLY = {
    "data": [{"id": "m", "max_model_len": 128}],
    "vllm_config": {"model_config": {"dtype": "torch.bfloat16"}},
    "choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}}],
}
HOLD_TIMEOUT_S = 10.0  # a held request is answered anyway after this long
_ORDER = itertools.count()  # arrival order across every upstream of a test


@dataclass
class Seen:
    """One request that reached a stand-in vLLM."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    order: int = 0


@dataclass
class Upstream:
    """A recording server: `status` is what it answers, after `delay_s`; while `hold` is clear,
    requests wait (up to HOLD_TIMEOUT_S) before the answer; `arrived` is set by every request."""

    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    status: int = 200
    delay_s: float = 0.0
    hold: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.hold.set()

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    def start(self, port: int = 0) -> Upstream:
        """Listen on `port` (0: a free one; the same port again: come back after `stop`)."""
        upstream = self

        class Handler(_Recorder):
            owner = upstream

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        return self

    def stop(self) -> None:
        """Stop listening: connections to the port are refused from now on."""
        self.hold.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(10)


class _Recorder(BaseHTTPRequestHandler):
    owner: Upstream

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        seen = Seen(self.command, self.path, dict(self.headers.items()), body, next(_ORDER))
        self.owner.seen.append(seen)
        self.owner.arrived.set()
        self.owner.hold.wait(HOLD_TIMEOUT_S)
        time.sleep(self.owner.delay_s)
        status = self.owner.status
        reply = json.dumps(REPLY if status < 400 else {"error": status}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _record

    def log_message(self, *args: object) -> None:
        pass


def seen_by(fleet: Iterable[Upstream]) -> list[Seen]:
    """Every request that reached any of `fleet`, in arrival order."""
    return sorted((s for u in fleet for s in u.seen), key=lambda s: s.order)


def call(
    proxy_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
    prefix: bool = True,
    timeout_s: float = 30.0,
) -> tuple[int, bytes]:
    """One request to the proxy at `proxy_url`; `path` goes after its secret prefix unless
    `prefix` is False; its own Host unless `headers` says otherwise."""
    parts = urlsplit(proxy_url)
    target = (parts.path if prefix else "") + path
    sent = {"Host": parts.netloc}
    if body is not None and content_type is not None:
        sent["Content-Type"] = content_type
    sent.update(headers or {})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
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
