"""Load on loopback: 256 concurrent full games, the 257th connection refused, slots released."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wordle_env.words import load_word_lists

CAPACITY = 256
DEADLINE_S = 120.0  # whole test, on two cores; it takes a few seconds
RECV_TIMEOUT_S = 30.0
RELEASE_WAIT_S = 10.0  # a closed session is released asynchronously, just after the socket
FILLERS = ("slate", "pious", "dwelt", "handy", "eerie", "robot")  # none is an answer below


async def _ask(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    return json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


def _script(i: int) -> tuple[str, list[str], float | None]:
    """Even sessions win on the sixth guess, odd ones lose after six (reward checked below)."""
    secret = next(w for w in load_word_lists().answers[i * 7 :] if w not in FILLERS)
    if i % 2 == 0:
        return secret, [*FILLERS[:5], secret], 1.0
    return secret, list(FILLERS), None


async def _session(url: str, i: int, all_reset: asyncio.Barrier, go: asyncio.Event) -> None:
    secret, guesses, expected = _script(i)
    async with connect(url, open_timeout=RECV_TIMEOUT_S) as ws:
        reply = await _ask(ws, {"type": "reset", "data": {"word": secret}})
        assert reply["type"] == "observation", reply
        await all_reset.wait()
        await go.wait()  # hold the slot until the 257th connection has been refused
        for n, guess in enumerate(guesses, start=1):
            reply = await _ask(ws, {"type": "step", "data": {"message": f"[{guess}]"}})
            assert reply["type"] == "observation", reply
            assert reply["data"]["done"] == (n == len(guesses))
        reward = reply["data"]["reward"]
        if expected is None:
            assert 0.0 <= reward < 1.0
        else:
            assert reward == expected
        transcript = reply["data"]["observation"]["messages"][0]["content"]
        assert transcript.count("You submitted") == (5 if expected == 1.0 else 6)
        await ws.send(json.dumps({"type": "close"}))


async def _refused(url: str) -> dict[str, Any]:
    async with connect(url, open_timeout=RECV_TIMEOUT_S) as ws:
        return json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


async def _reset_all(url: str, polite: bool) -> None:
    """Fill every slot again and reset each; ``polite`` sends OpenEnv's close message.

    A slot may still be held for a moment by the session that just closed it, so a refused
    connection is retried until RELEASE_WAIT_S.
    """
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        deadline = loop.time() + RELEASE_WAIT_S
        while True:
            async with connect(url, open_timeout=RECV_TIMEOUT_S) as ws:
                try:
                    reply = await _ask(ws, {"type": "reset", "data": {"seed": i}})
                except ConnectionClosed:  # refused and closed before our reset went out
                    reply = {"type": "error", "data": {"code": "CAPACITY_REACHED"}}
                if reply["type"] == "observation":
                    if polite:
                        await ws.send(json.dumps({"type": "close"}))
                    return
            assert reply["data"]["code"] == "CAPACITY_REACHED", reply
            assert loop.time() < deadline, f"slot not released within {RELEASE_WAIT_S} s"
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(CAPACITY)))


async def _load(url: str) -> None:
    all_reset, go = asyncio.Barrier(CAPACITY + 1), asyncio.Event()
    sessions = [asyncio.create_task(_session(url, i, all_reset, go)) for i in range(CAPACITY)]
    try:
        await all_reset.wait()
        reply = await _refused(url)
        assert reply["type"] == "error" and reply["data"]["code"] == "CAPACITY_REACHED", reply
        assert reply["data"]["max_sessions"] == CAPACITY
    finally:
        go.set()
    await asyncio.gather(*sessions)
    # Released on close: a second full round fits, and a third after disconnects without close.
    await _reset_all(url, polite=True)
    await _reset_all(url, polite=False)
    await _reset_all(url, polite=True)


@pytest.mark.whole_machine  # 256 sessions against deadlines
def test_256_concurrent_games_then_capacity_and_release(load_server_url: str) -> None:
    url = load_server_url.replace("http://", "ws://") + "/ws"
    asyncio.run(asyncio.wait_for(_load(url), DEADLINE_S))
