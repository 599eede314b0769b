"""The trainer's loopback proxy: adds the bearer token, and answers 502 (quietly) while the
rollout server is down, e.g. a replica that is restarting."""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.auth_proxy import AuthProxy


class _Echo(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = json.dumps(
            {"auth": self.headers.get("Authorization"), "path": self.path, "body": body.decode()}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_forwards_with_the_token():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        upstream = f"http://127.0.0.1:{server.server_address[1]}"
        with AuthProxy(upstream, "secret") as proxy:
            status, body = _post(f"{proxy.url}/v1/completions?x=1", b'{"prompt": [1]}')
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200
    assert json.loads(body) == {
        "auth": "Bearer secret",
        "path": "/v1/completions?x=1",
        "body": '{"prompt": [1]}',
    }


def test_upstream_down_is_a_quiet_502(caplog: pytest.LogCaptureFixture):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.ERROR), AuthProxy(f"http://127.0.0.1:{port}", "secret") as proxy:
        status, body = _post(f"{proxy.url}/v1/completions", b"{}")
    assert status == 502 and b"unreachable" in body and b"secret" not in body
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")]
