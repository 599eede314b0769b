"""Hostile input over HTTP and WebSocket: a bounded 422 or error frame, one log line, no change."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

LONG = "x" * 10_000  # past every field bound, within the 16 KiB body bound
MAX_REPLY_BYTES = 2_000  # a refusal names the problem; it never echoes a long input back
RECV_TIMEOUT_S = 10.0

# (route, raw JSON body, a phrase the refusal must contain)
HOSTILE_HTTP = [
    ("/reset", '{"seed": 1e400}', "seed"),
    ("/reset", '{"seed": -1}', "seed"),
    ("/reset", json.dumps({"word": LONG}), "word: String should have at most 5 characters"),
    ("/reset", json.dumps({"word": "xqzvw"}), "word: 'xqzvw' is not an allowed guess"),
    ("/reset", json.dumps({"word": "cr\u00e4ne"}), "is not an allowed guess"),
    ("/reset", json.dumps({"word": {"$ne": ""}}), "word: Input should be a valid string"),
    ("/reset", json.dumps({"episode_id": LONG}), "at most 255 characters"),
    ("/reset", json.dumps({"colour\nsecond line": 1}), "Extra inputs are not permitted"),
    ("/reset", "{not json", "JSON decode error"),
    ("/step", '{"action": {"message": 1e400}}', "message"),
    ("/step", json.dumps({"action": {"message": LONG}}), "message"),
]


def _post(url: str, body: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read()


@pytest.mark.parametrize(
    ("route", "body", "phrase"),
    HOSTILE_HTTP,
    ids=[
        "seed-1e400",
        "seed-negative",
        "word-10k",
        "word-not-a-guess",
        "word-non-ascii",
        "word-object",
        "episode-id-10k",
        "unknown-option-with-newline",
        "not-json",
        "step-message-1e400",
        "step-message-10k",
    ],
)
def test_hostile_http_input_is_a_422_with_one_log_line(
    wordle_server: Any, route: str, body: str, phrase: str
) -> None:
    lines_before = wordle_server.log.read_text().splitlines()
    status, reply = _post(wordle_server.url + route, body)
    assert status == 422, reply[:500]
    assert len(reply) < MAX_REPLY_BYTES
    assert phrase in reply.decode()
    # The line is written before the answer is sent.
    new_lines = wordle_server.log.read_text().splitlines()[len(lines_before) :]
    assert len(new_lines) == 1, new_lines
    assert f"POST {route} refused (422): " in new_lines[0]
    assert len(new_lines[0]) < 500 and "Traceback" not in new_lines[0]


def test_http_still_serves_after_hostile_input(wordle_server: Any) -> None:
    for route, body, _ in HOSTILE_HTTP:
        _post(wordle_server.url + route, body)
    status, reply = _post(wordle_server.url + "/reset", '{"word": "crane", "episode_id": "ok"}')
    assert status == 200
    assert "You are Playing Wordle" in json.loads(reply)["observation"]["messages"][0]["content"]
    assert "Traceback" not in wordle_server.log.read_text()


HOSTILE_RESETS = [
    '{"seed": 1e400}',
    json.dumps({"episode_id": LONG}),
    json.dumps({"word": LONG}),
    json.dumps({"word": "xqzvw"}),
    json.dumps({"word": ["crane"]}),
    json.dumps({LONG: 1}),
]


async def _ask(ws: ClientConnection, frame: str) -> dict[str, Any]:
    await ws.send(frame)
    reply = await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
    assert len(reply) < MAX_REPLY_BYTES, reply[:500]
    return json.loads(reply)


def test_hostile_websocket_reset_is_an_error_frame_and_keeps_the_game(wordle_server: Any) -> None:
    async def run() -> None:
        async with connect(wordle_server.url.replace("http://", "ws://") + "/ws") as ws:
            await _ask(ws, json.dumps({"type": "reset", "data": {"word": "crane"}}))
            await _ask(ws, json.dumps({"type": "step", "data": {"message": "[slate]"}}))
            for data in HOSTILE_RESETS:
                reply = await _ask(ws, f'{{"type": "reset", "data": {data}}}')
                assert reply["type"] == "error", reply
                assert reply["data"]["code"] == "EXECUTION_ERROR"
                assert reply["data"]["message"].startswith("invalid reset options (")
            state = await _ask(ws, json.dumps({"type": "state"}))
            assert (state["data"]["step_count"], len(state["data"]["episode_id"])) == (1, 36)
            reply = await _ask(ws, json.dumps({"type": "step", "data": {"message": "[crane]"}}))
            assert (reply["data"]["reward"], reply["data"]["done"]) == (1.0, True)
            reset = {"type": "reset", "data": {"seed": 3, "episode_id": "e" * 255}}
            assert (await _ask(ws, json.dumps(reset)))["type"] == "observation"
            state = await _ask(ws, json.dumps({"type": "state"}))
            assert state["data"]["episode_id"] == "e" * 255
            await ws.send(json.dumps({"type": "close"}))

    asyncio.run(run())
    assert "Traceback" not in wordle_server.log.read_text()
