"""Who may play: the API key on the play routes, bounded bodies, a session's lifetime and cap."""

from __future__ import annotations

import pickle
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from conftest import ENV_API_KEY
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from trainer.envs.sessions import WordleTool
from trainer.envs.spec import preflight, resolve
from wordle_env.server.app import create_wordle_app
from wordle_env.server.sessions import POLICY_CLOSE_CODE, SessionLimits

RESET = {"type": "reset", "data": {"word": "crane"}}
STEP = {"type": "step", "data": {"message": "[slate]"}}
BEARER = {"Authorization": f"Bearer {ENV_API_KEY}"}


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("route", ["/step", "/reset"])
def test_oversized_play_bodies_get_413(wordle_server: Any, route: str) -> None:
    status, reply = _post(wordle_server.url + route, b" " * 100_000)
    assert status == 413, reply[:200]
    assert b"over 16384 bytes" in reply


def test_bodies_within_the_bound_still_play(wordle_server: Any) -> None:
    status, reply = _post(wordle_server.url + "/reset", b'{"word": "crane"}')
    assert status == 200, reply[:200]


def test_the_key_guards_the_play_routes_only(keyed_server: Any) -> None:
    url = keyed_server.url
    assert _post(url + "/reset", b"{}")[0] == 401
    assert _post(url + "/reset", b"{}", {"Authorization": "Bearer " + ENV_API_KEY[:-1]})[0] == 401
    assert _post(url + "/reset", b"{}", BEARER)[0] == 200
    with urllib.request.urlopen(url + "/health", timeout=10) as response:  # the Hub's probe
        assert response.status == 200
    assert ENV_API_KEY not in keyed_server.log.read_text()


def test_a_keyed_server_plays_only_with_the_trainers_key(keyed_server: Any) -> None:
    """The trainer's tool (pickled, as TRL's rollout worker gets it) sends the key."""
    env = pickle.loads(pickle.dumps(WordleTool(base_url=keyed_server.url, api_key=ENV_API_KEY)))
    assert "You are Playing Wordle" in env.reset(word="crane")
    env.guess("crane")
    assert env.get_reward() == 1.0 and env.done
    with pytest.raises(ConnectionError):
        WordleTool(base_url=keyed_server.url).reset(word="crane")


def test_the_trainers_preflight_passes_the_key(keyed_server: Any) -> None:
    spec = preflight(resolve("wordle", keyed_server.url, ENV_API_KEY))
    assert spec.tools == ("guess",)


def _session(limits: SessionLimits) -> TestClient:
    return TestClient(create_wordle_app(4, limits))


@pytest.mark.whole_machine  # plays within a 1.5 s lifetime
def test_a_session_ends_at_its_lifetime_however_it_plays() -> None:
    limits = SessionLimits(first_message_s=30, idle_s=30, lifetime_s=1.5)
    with _session(limits) as client, client.websocket_connect("/ws") as ws:
        for _ in range(3):  # playing keeps the idle deadline away, not the lifetime
            ws.send_json(RESET)
            assert ws.receive_json()["type"] == "observation"
            time.sleep(0.4)
        time.sleep(0.6)
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == POLICY_CLOSE_CODE
        assert "lifetime of 1.5 s" in closed.value.reason


def test_a_session_ends_at_its_step_cap() -> None:
    with _session(SessionLimits(max_steps=3)) as client, client.websocket_connect("/ws") as ws:
        for frame in (RESET, STEP, STEP):
            ws.send_json(frame)
            assert ws.receive_json()["type"] == "observation"
        ws.send_json(STEP)
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert (closed.value.code, closed.value.reason) == (
            POLICY_CLOSE_CODE,
            "3 steps, the session's cap",
        )
