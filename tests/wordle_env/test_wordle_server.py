"""Full games and bad input over the WebSocket protocol, through a real server on loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wordle_env import WordleAction, WordleEnv

RECV_TIMEOUT_S = 10.0
# TextArena's reset transcript, written out so the tests pin the wire format.
INTRO = (
    "\n[GAME] You are Playing Wordle.\n"
    "A secret 5-letter word has been chosen. You have 6 attempts to guess it.\n"
    "For each guess, wrap your word in square brackets (e.g., '[apple]').\n"
    "Feedback for each letter will be given as follows:\n"
    "  - G (green): correct letter in the correct position\n"
    "  - Y (yellow): letter exists in the word but in the wrong position\n"
    "  - X (wrong): letter is not in the word\n"
    "Enter your guess to begin.\n"
)
WARNING = (
    "\n[GAME] You attempted an invalid move. Reason: {} Please resubmit a valid move and "
    "remember to follow the game rules to avoid penalties."
)


def _feedback(word: str, marks: str, left: int) -> str:
    return (
        f"\n[GAME] [{word}]\n[GAME] You submitted [{word}].\nFeedback:\n"
        f"{' '.join(word.upper())}\n{' '.join(marks)}\nYou have {left} guesses left."
    )


# (message sent, transcript added, reward, done) for each step; the secret is "crane".
WIN = [
    ("[slate]", _feedback("slate", "XXGXG", 5), 0.0, False),
    ("crane", "\n[GAME] [crane]", 1.0, True),
]
LOSS = [
    ("[slate]", _feedback("slate", "XXGXG", 5), 0.0, False),
    ("[pious]", _feedback("pious", "XXXXX", 4), 0.0, False),
    ("[dwelt]", _feedback("dwelt", "XXYXX", 3), 0.0, False),
    ("[handy]", _feedback("handy", "XYYXX", 2), 0.0, False),
    ("[eerie]", _feedback("eerie", "XXYXG", 1), 0.0, False),
    ("[react]", _feedback("react", "YYGYX", 0), 0.5, True),
]
BRACKETS = (
    "You tried submitting a word in the wrong format. Please make sure to use squared brackets."
)
INVALID = [
    ("[slate]", _feedback("slate", "XXGXG", 5), 0.0, False),
    ("hello there", "\n[GAME] [hello there]" + WARNING.format(BRACKETS), 0.0, False),
    ("[xqzvw]", "\n[GAME] [xqzvw]", 0.4, True),  # ends the game: completion of [slate]
]


def _ws_url(server_url: str) -> str:
    return server_url.replace("http://", "ws://") + "/ws"


async def _ask(ws: ClientConnection, frame: Any) -> dict[str, Any]:
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    return json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


async def _close(ws: ClientConnection) -> None:
    await ws.send(json.dumps({"type": "close"}))  # the server releases the session first


@pytest.mark.parametrize("script", [WIN, LOSS, INVALID], ids=["win", "loss", "invalid"])
def test_full_game_transcripts(server_url: str, script: list[tuple[str, str, float, bool]]) -> None:
    async def play() -> None:
        async with connect(_ws_url(server_url)) as ws:
            reply = await _ask(ws, {"type": "reset", "data": {"word": "crane"}})
            assert reply["type"] == "observation"
            transcript = INTRO
            assert reply["data"]["observation"]["messages"][0]["content"] == transcript
            assert (reply["data"]["reward"], reply["data"]["done"]) == (0.0, False)
            for message, added, reward, done in script:
                reply = await _ask(ws, {"type": "step", "data": {"message": message}})
                transcript += added
                data = reply["data"]
                assert data["observation"]["messages"][0]["content"] == transcript
                assert (data["reward"], data["done"]) == (reward, done)
            await _close(ws)

    asyncio.run(play())


def test_wire_observation_has_textarena_fields(server_url: str) -> None:
    async def reset() -> dict[str, Any]:
        async with connect(_ws_url(server_url)) as ws:
            reply = await _ask(ws, {"type": "reset", "data": {"word": "crane"}})
            await _close(ws)
            return reply["data"]["observation"]

    observation = asyncio.run(reset())
    assert set(observation) == {"prompt", "messages", "current_player_id", "legal_players", "info"}
    assert observation["messages"] == [{"sender_id": -1, "content": INTRO, "category": "MESSAGE"}]
    assert observation["prompt"] == INTRO.strip()
    assert (observation["current_player_id"], observation["legal_players"]) == (0, [0])


def test_typed_sync_client(server_url: str) -> None:
    with WordleEnv(base_url=server_url).sync() as env:
        result = env.reset(word="crane", episode_id="typed")
        assert result.observation.messages[0].content == INTRO
        result = env.step(WordleAction(message="[react]"))
        assert (result.reward, result.done) == (0.0, False)
        assert result.observation.info["reward_signals"]["wordle.yellows"] == 0.6
        result = env.step(WordleAction(message="crane"))
        assert (result.reward, result.done) == (1.0, True)
        state = env.state()
        assert (state.episode_id, state.step_count, state.turn) == ("typed", 2, 2)
        assert state.raw_state["secret_word"] == "crane"


def test_trl_style_wrapper_with_generic_client(server_url: str) -> None:
    """TRL's Wordle wrapper: new feedback = transcript minus the previous one; dicts only."""
    with GenericEnvClient(base_url=server_url).sync() as env:
        result = env.reset(word="crane")
        last = result.observation["messages"][0]["content"]
        feedbacks = []
        for guess in ("[slate]", "[slate]", "[crane]"):
            result = env.step({"message": guess})
            full = result.observation["messages"][0]["content"]
            feedbacks.append(full[len(last) :])
            last = full
        assert feedbacks[0] == _feedback("slate", "XXGXG", 5)
        assert "You attempted an invalid move" in feedbacks[1]
        assert feedbacks[2] == "\n[GAME] [crane]"
        assert (result.reward, result.done) == (1.0, True)


def test_seeded_reset_is_reproducible_over_the_wire(server_url: str) -> None:
    def outcome(seed: int) -> tuple[str, float]:
        with WordleEnv(base_url=server_url).sync() as env:
            env.reset(seed=seed)
            env.step(WordleAction(message="[slate]"))
            result = env.step(WordleAction(message="[pious]"))
            return result.observation.messages[0].content, env.state().turn

    assert outcome(11) == outcome(11)


BAD_FRAMES = [
    ("{not json", "INVALID_JSON"),
    ({"type": "jump"}, "UNKNOWN_TYPE"),
    ({"data": {}}, "UNKNOWN_TYPE"),
    ({"type": "step"}, "VALIDATION_ERROR"),
    ({"type": "step", "data": "crane"}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": 5}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": "[crane]", "colour": "g"}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": "x" * 257}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": "x" * 100_000}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": "[cr\u00e4ne]"}}, "VALIDATION_ERROR"),
    ({"type": "step", "data": {"message": "\U0001f7e9"}}, "VALIDATION_ERROR"),
    ({"type": "reset", "data": {"seed": "7"}}, "EXECUTION_ERROR"),
    ({"type": "reset", "data": {"word": "xqzvw"}}, "EXECUTION_ERROR"),
    ({"type": "reset", "data": {"colour": "green"}}, "EXECUTION_ERROR"),
]


def test_bad_input_gives_error_frames_and_harms_nothing(server_url: str) -> None:
    async def run() -> None:
        async with connect(_ws_url(server_url)) as ws, connect(_ws_url(server_url)) as other:
            await _ask(ws, {"type": "reset", "data": {"word": "crane"}})
            await _ask(other, {"type": "reset", "data": {"word": "crane"}})
            for frame, code in BAD_FRAMES:
                reply = await _ask(ws, frame)
                assert reply["type"] == "error", frame
                assert reply["data"]["code"] == code, (frame, reply)
                assert reply["data"]["message"]
            # The same session still holds its game, untouched by the bad frames...
            reply = await _ask(ws, {"type": "step", "data": {"message": "[slate]"}})
            assert reply["data"]["observation"]["messages"][0]["content"] == INTRO + WIN[0][1]
            # ...and so does the other one.
            reply = await _ask(other, {"type": "step", "data": {"message": "crane"}})
            assert (reply["data"]["reward"], reply["data"]["done"]) == (1.0, True)
            await _close(ws)
            await _close(other)

    asyncio.run(run())


@pytest.mark.parametrize(
    "frame",
    [json.dumps([1, 2]), json.dumps("reset"), "x" * (2 << 20)],
    ids=["json-array", "json-string", "frame-over-1MiB"],
)
def test_unparseable_frames_end_only_their_session(server_url: str, frame: str) -> None:
    """OpenEnv drops a session whose frame is not a JSON object; others carry on."""

    async def run() -> None:
        async with connect(_ws_url(server_url)) as other:
            await _ask(other, {"type": "reset", "data": {"word": "crane"}})
            async with connect(_ws_url(server_url)) as ws:
                await ws.send(frame)
                with pytest.raises(ConnectionClosed):  # an error frame may come first
                    for _ in range(2):
                        await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
            reply = await _ask(other, {"type": "step", "data": {"message": "crane"}})
            assert reply["data"]["reward"] == 1.0
            await _close(other)

    asyncio.run(run())
    with urllib.request.urlopen(f"{server_url}/health", timeout=5) as response:
        assert json.load(response) == {"status": "healthy"}


def test_step_before_reset_and_after_end_over_the_wire(server_url: str) -> None:
    async def run() -> None:
        async with connect(_ws_url(server_url)) as ws:
            reply = await _ask(ws, {"type": "step", "data": {"message": "[crane]"}})
            data = reply["data"]
            assert (data["done"], data["reward"]) == (True, 0.0)
            assert data["observation"]["info"]["error"].startswith("No game in progress")
            await _ask(ws, {"type": "reset", "data": {"word": "crane"}})
            await _ask(ws, {"type": "step", "data": {"message": "[crane]"}})
            reply = await _ask(ws, {"type": "step", "data": {"message": "[slate]"}})
            data = reply["data"]
            assert (data["done"], data["reward"]) == (True, 1.0)
            assert data["observation"]["info"]["error"].startswith("The game is over")
            await _close(ws)

    asyncio.run(run())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def test_stateless_http_routes(server_url: str) -> None:
    """HTTP /reset and /step build a fresh env per request: /step never has a game."""
    reset = _post(f"{server_url}/reset", {"word": "crane"})
    assert reset["observation"]["messages"][0]["content"] == INTRO
    step = _post(f"{server_url}/step", {"action": {"message": "[crane]"}})
    assert step["done"] is True and "error" in step["observation"]["info"]
    with urllib.request.urlopen(f"{server_url}/schema", timeout=10) as response:
        schema = json.load(response)
    assert schema["action"]["properties"]["message"]["maxLength"] == 256
