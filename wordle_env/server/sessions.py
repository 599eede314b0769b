"""Who may hold a session slot: only a client that plays keeps one; ``/mcp`` opens no sessions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

__all__ = [
    "DEFAULT_FIRST_MESSAGE_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_LIFETIME_S",
    "DEFAULT_MAX_STEPS",
    "IDLE_CLOSE_CODE",
    "MAX_INVALID_FRAMES",
    "POLICY_CLOSE_CODE",
    "NoMcpSessions",
    "SessionDeadlines",
    "SessionLimits",
]

# A trainer sends reset right after connecting; the first message has a short deadline.
DEFAULT_FIRST_MESSAGE_TIMEOUT_S = 10.0
# Between messages a trainer may wait for a whole generation (or a weight sync): minutes.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# A session's whole life: a rollout plays one game (seconds to minutes of generation).
DEFAULT_LIFETIME_S = 3600.0
# Resets and steps answered in one session; a rollout needs 7 (a reset and six guesses).
DEFAULT_MAX_STEPS = 1000
# Error answers in a row after which the session is closed: a player makes a few, a squatter many.
MAX_INVALID_FRAMES = 16
# Private-use close code, after HTTP's 408 Request Timeout.
IDLE_CLOSE_CODE = 4408
# WebSocket's "policy violation": invalid frames, or past the session's lifetime or step cap.
POLICY_CLOSE_CODE = 1008

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionLimits:
    """How long, and for how much play, the server keeps a client's WebSocket.

    Only a reset or step the server answered with an observation counts as play: invalid
    frames (answered with an error) move no deadline.

    Attributes:
        first_message_s: from the server's accept to the first answered reset or step.
        idle_s: from each answered reset or step to the next one; a trainer may wait this long
            for a generation or a weight sync, so keep it generous.
        lifetime_s: from the accept to the close, whatever the client does.
        max_steps: answered resets and steps in one session.
    """

    first_message_s: float = DEFAULT_FIRST_MESSAGE_TIMEOUT_S
    idle_s: float = DEFAULT_IDLE_TIMEOUT_S
    lifetime_s: float = DEFAULT_LIFETIME_S
    max_steps: int = DEFAULT_MAX_STEPS

    def __post_init__(self) -> None:
        for name in ("first_message_s", "idle_s", "lifetime_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not (isinstance(self.max_steps, int) and self.max_steps > 0):
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")


class SessionDeadlines:
    """Close a WebSocket that does not play (close code 4408 when silent, 1008 otherwise).

    A slot is held from the accept, so the deadlines move only when the server answers a reset
    or step with an observation: a socket that sends anything else (``x`` every few seconds)
    loses its slot at the first-message deadline, and ``MAX_INVALID_FRAMES`` error answers in
    a row close a session at once. Silence alone never ends a session before ``idle_s``.

    Closing the socket makes OpenEnv's own handler release the slot, once. Not OpenEnv's
    ``ConcurrencyConfig.session_timeout``: openenv-core 0.3.0's reaper frees the slot but leaves
    the socket open and playing outside the count, and looks at most every 5 s. No per-address
    limit: behind the Spaces proxy every client has the proxy's address, and a trainer
    legitimately opens many sessions.
    """

    def __init__(self, app: ASGIApp, limits: SessionLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket" or scope["path"] != "/ws":  # /ws/ui holds no session
            await self.app(scope, receive, send)
            return
        limits = self.limits
        clock = asyncio.get_running_loop().time
        started = clock()
        deadline, end = started + limits.first_message_s, started + limits.lifetime_s
        calls = steps = invalid = 0
        closed = False

        async def close(code: int, reason: str) -> Message:
            nonlocal closed
            closed = True
            _log.info("closed a /ws session: %s", reason)
            with contextlib.suppress(OSError):  # the client may have gone at the same moment
                await send({"type": "websocket.close", "code": code, "reason": reason})
            return {"type": "websocket.disconnect", "code": code}

        async def guarded_receive() -> Message:
            nonlocal calls
            calls += 1
            if calls == 1 or closed:  # the handshake's websocket.connect comes at once
                return await receive()
            if invalid >= MAX_INVALID_FRAMES:
                return await close(POLICY_CLOSE_CODE, f"{invalid} invalid messages in a row")
            if steps >= limits.max_steps:
                return await close(POLICY_CLOSE_CODE, f"{steps} steps, the session's cap")
            try:
                async with asyncio.timeout_at(min(deadline, end)):  # cancelling loses nothing
                    return await receive()
            except TimeoutError:
                pass
            if clock() >= end:
                return await close(POLICY_CLOSE_CODE, f"lifetime of {limits.lifetime_s:g} s over")
            limit = limits.idle_s if steps else limits.first_message_s
            return await close(IDLE_CLOSE_CODE, f"no reset or step within {limit:g} s")

        async def watched_send(message: Message) -> None:
            nonlocal deadline, steps, invalid
            if closed:  # after our close, OpenEnv's own close has nothing left to do
                return
            answer = _answer_type(message)
            if answer == "observation":
                deadline, steps, invalid = clock() + limits.idle_s, steps + 1, 0
            elif answer == "error":
                invalid += 1
            await send(message)

        await self.app(scope, guarded_receive, watched_send)


def _answer_type(message: Message) -> str | None:
    """The ``type`` of a text frame the server sends (OpenEnv's answers are JSON objects)."""
    text = message.get("text") if message["type"] == "websocket.send" else None
    try:
        answer = json.loads(text) if text else None
    except ValueError:
        return None
    return answer.get("type") if isinstance(answer, dict) else None


class NoMcpSessions:
    """Answer ``/mcp`` here, so that nothing but a ``/ws`` connection can hold a session.

    Wordle has no MCP tools, and openenv-core 0.3.0's HTTP ``openenv/session/create`` holds a
    slot with no connection and no end (256 POSTs filled the server for good). ``POST /mcp``
    still answers JSON-RPC 2.0, which ``openenv validate`` checks; ``/mcp`` WebSockets get 403.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"].rstrip("/") != "/mcp":
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await WebSocketClose(code=1008, reason="no MCP here; play over /ws")(
                scope, receive, send
            )
        else:
            error = {"code": -32601, "message": "Wordle has no MCP tools; play over /ws"}
            body = {"jsonrpc": "2.0", "id": None, "error": error}
            await JSONResponse(body)(scope, receive, send)
