"""The replica client turns every broken answer into a `ReplicaError` (which the trainer counts as
a failed attempt), including a server that dies halfway through a response."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from deltasync.vllm_ext.client import ReplicaClient, ReplicaError


def _serve_once(listener: socket.socket, reply: bytes) -> None:
    conn, _ = listener.accept()
    with conn:
        _read_request(conn)  # all of it: closing on unread bytes would reset the connection
        conn.sendall(reply)  # then close: what a SIGKILLed server leaves behind


def _read_request(conn: socket.socket) -> None:
    """The request's head and its `Content-Length` body (urllib may send them apart)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk


@pytest.fixture
def answering() -> Iterator:
    """A loopback server that answers one request with the given raw bytes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    threads = []

    def start(reply: bytes) -> ReplicaClient:
        thread = threading.Thread(target=_serve_once, args=(listener, reply), daemon=True)
        thread.start()
        threads.append(thread)
        return ReplicaClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=10)

    yield start
    for thread in threads:
        thread.join(timeout=10)
    listener.close()


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"ok"', "broke off"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnope!", "answered no JSON"),
        (b"garbage\r\n\r\n", "broke off|unreachable"),
        (b"", "unreachable"),
    ],
    ids=["body-cut-short", "not-json", "no-status-line", "closed-silently"],
)
def test_broken_answers_are_replica_errors(answering, reply, message):
    client = answering(reply)
    with pytest.raises(ReplicaError, match=message):
        client.request("POST", "/deltasync/sync", {"version": 1})


def _rpc_reply(results: list) -> bytes:
    body = json.dumps({"results": results}).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


def test_engine_digests_are_each_workers(answering):
    workers = [{"version": 3, "digests": {"a.weight": "01"}}, {"version": 3, "digests": {}}]
    assert answering(_rpc_reply(workers)).engine_digests() == (3, [{"a.weight": "01"}, {}])


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([{"version": 3, "digests": {}}, {"version": 4, "digests": {}}], "different versions"),
        ([{"version": 3, "digests": {}}, None], "sent no digests"),
    ],
    ids=["versions-differ", "a-worker-silent"],
)
def test_engine_digests_refuse_workers_that_disagree(answering, results, message):
    with pytest.raises(ReplicaError, match=message):
        answering(_rpc_reply(results)).engine_digests()
