"""Starvation: 256 WebSockets that do not play lose their slots; /mcp holds no session."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from wordle_env.server.sessions import IDLE_CLOSE_CODE, MAX_INVALID_FRAMES, POLICY_CLOSE_CODE

pytestmark = pytest.mark.whole_machine  # 256 sockets against deadlines of 6 and 8 s
CAPACITY = 256
OPEN_TIMEOUT_S = 30.0
RECV_TIMEOUT_S = 10.0
ADMIT_SLACK_S = 10.0  # after the deadline, a new client must be playing within this
RESET = {"type": "reset", "data": {"word": "crane"}}


def _ws(server: Any) -> str:
    return server.url.replace("http://", "ws://") + "/ws"


def _limits(server: Any) -> tuple[float, float]:
    settings = server.settings
    return (
        float(settings["SESSION_FIRST_MESSAGE_TIMEOUT_S"]),
        float(settings["SESSION_IDLE_TIMEOUT_S"]),
    )


async def _ask(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    return json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


async def _try_reset(url: str) -> str:
    """One newcomer: the code of its error frame, or "observation" if it got a game."""
    async with connect(url, open_timeout=OPEN_TIMEOUT_S) as ws:
        try:
            reply = await _ask(ws, RESET)
        except ConnectionClosed:  # refused and closed before the reset went out
            return "CAPACITY_REACHED"
        if reply["type"] != "observation":
            return reply["data"]["code"]
        await ws.send(json.dumps({"type": "close"}))
    return "observation"


async def _admit(url: str, seconds: float) -> None:
    """Retry a newcomer every 0.25 s until it gets a game; fail after ``seconds``."""
    for _ in range(int(seconds / 0.25) + 1):
        code = await _try_reset(url)
        if code == "observation":
            return
        assert code == "CAPACITY_REACHED", code
        await asyncio.sleep(0.25)
    pytest.fail(f"no slot freed within {seconds} s")


async def _closed_by_server(conns: list[ClientConnection]) -> list[int | None]:
    await asyncio.wait_for(asyncio.gather(*(ws.wait_closed() for ws in conns)), RECV_TIMEOUT_S)
    return [ws.close_code for ws in conns]


async def _fill(url: str) -> list[ClientConnection]:
    return list(
        await asyncio.gather(*(connect(url, open_timeout=OPEN_TIMEOUT_S) for _ in range(CAPACITY)))
    )


def test_silent_connections_lose_their_slots_at_the_first_message_deadline(
    deadline_server: Any,
) -> None:
    first_message_s, _ = _limits(deadline_server)
    url = _ws(deadline_server)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        silent = await _fill(url)  # connect and never send: the attack
        try:
            assert await _try_reset(url) == "CAPACITY_REACHED"
            await _admit(url, first_message_s + ADMIT_SLACK_S)
            assert loop.time() - start >= first_message_s  # not before the deadline
            codes = await _closed_by_server(silent)
            assert codes == [IDLE_CLOSE_CODE] * CAPACITY
            assert f"no reset or step within {first_message_s:g} s" == silent[0].close_reason
        finally:
            await asyncio.gather(*(ws.close() for ws in silent))

    asyncio.run(asyncio.wait_for(run(), 90))


def test_idle_sessions_lose_their_slots_and_active_ones_keep_theirs(
    deadline_server: Any,
) -> None:
    _, idle_s = _limits(deadline_server)
    url = _ws(deadline_server)

    async def keep_playing(ws: ClientConnection, until: asyncio.Event) -> int:
        """Reset every idle_s / 4 until told to stop; the number of answers."""
        answers = 0
        for _ in range(200):  # bounded: 200 x idle_s / 4
            if until.is_set():
                break
            reply = await _ask(ws, RESET)
            assert reply["type"] == "observation", reply
            answers += 1
            await asyncio.sleep(idle_s / 4)
        return answers

    async def run() -> None:
        loop = asyncio.get_running_loop()
        conns = await _fill(url)
        try:
            start = loop.time()
            replies = await asyncio.gather(*(_ask(ws, RESET) for ws in conns))
            assert all(reply["type"] == "observation" for reply in replies)
            active, idle = conns[0], conns[1:]  # all 256 slots held, 255 of them gone silent
            done = asyncio.Event()
            player = asyncio.create_task(keep_playing(active, done))
            assert await _try_reset(url) == "CAPACITY_REACHED"
            await _admit(url, idle_s + ADMIT_SLACK_S)
            assert loop.time() - start >= idle_s  # not before the idle timeout
            assert await _closed_by_server(idle) == [IDLE_CLOSE_CODE] * (CAPACITY - 1)
            done.set()
            assert await asyncio.wait_for(player, RECV_TIMEOUT_S) >= 4  # over idle_s in all
            reply = await _ask(active, {"type": "step", "data": {"message": "[crane]"}})
            assert (reply["data"]["reward"], reply["data"]["done"]) == (1.0, True)
        finally:
            await asyncio.gather(*(ws.close() for ws in conns))

    asyncio.run(asyncio.wait_for(run(), 90))


def test_invalid_frames_hold_no_slot(deadline_server: Any) -> None:
    """256 sockets sending ``x`` every 2 s (answered with error frames, under every deadline)
    lose their slots at the first-message deadline: only an answered reset or step is play."""
    first_message_s, _ = _limits(deadline_server)
    url = _ws(deadline_server)

    async def chatter(ws: ClientConnection) -> None:
        for _ in range(60):  # bounded: 60 x 2 s
            try:
                await ws.send("x")
            except ConnectionClosed:
                return
            await asyncio.sleep(2.0)

    async def run() -> None:
        conns = await _fill(url)
        talkers = [asyncio.create_task(chatter(ws)) for ws in conns]
        try:
            assert await _try_reset(url) == "CAPACITY_REACHED"
            await _admit(url, first_message_s + ADMIT_SLACK_S)
            assert await _closed_by_server(conns) == [IDLE_CLOSE_CODE] * CAPACITY
        finally:
            for task in talkers:
                task.cancel()
            await asyncio.gather(*(ws.close() for ws in conns))

    asyncio.run(asyncio.wait_for(run(), 90))


def test_invalid_frames_in_a_row_close_a_session(server_url: str) -> None:
    """A player's few bad frames are forgiven by its next move; a run of them closes it (1008)."""
    url = server_url.replace("http://", "ws://") + "/ws"

    async def run() -> None:
        async with connect(url, open_timeout=OPEN_TIMEOUT_S) as ws:
            assert (await _ask(ws, RESET))["type"] == "observation"
            for _ in range(2):
                for _ in range(MAX_INVALID_FRAMES - 1):
                    await ws.send("x")
                    reply = json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
                    assert reply["type"] == "error"
                assert (await _ask(ws, RESET))["type"] == "observation"
            for _ in range(MAX_INVALID_FRAMES):
                await ws.send("x")
                await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
            await asyncio.wait_for(ws.wait_closed(), RECV_TIMEOUT_S)  # without another frame
            assert ws.close_code == POLICY_CLOSE_CODE
            assert ws.close_reason == f"{MAX_INVALID_FRAMES} invalid messages in a row"

    asyncio.run(asyncio.wait_for(run(), 60))


def test_mcp_holds_no_session(server_url: str) -> None:
    """openenv-core 0.3.0 let 256 ``openenv/session/create`` POSTs fill the server for good."""
    create = {"jsonrpc": "2.0", "method": "openenv/session/create", "id": 1}
    for body in (create, {}):  # {} is what ``openenv validate`` sends
        request = urllib.request.Request(
            f"{server_url}/mcp", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            reply = json.load(response)
        assert reply["jsonrpc"] == "2.0" and "result" not in reply, reply
        assert "play over /ws" in reply["error"]["message"]

    async def mcp_socket() -> None:
        mcp_url = server_url.replace("http://", "ws://") + "/mcp"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(mcp_url, open_timeout=OPEN_TIMEOUT_S):
                pass
        assert refused.value.response.status_code == 403

    asyncio.run(mcp_socket())
