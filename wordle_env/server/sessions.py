"""Who may hold a session slot: silent WebSockets are closed, ``/mcp`` opens no sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

__all__ = [
    "DEFAULT_FIRST_MESSAGE_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "IDLE_CLOSE_CODE",
    "NoMcpSessions",
    "SessionDeadlines",
    "SessionLimits",
]

# A trainer sends reset right after connecting; the first message has a short deadline.
DEFAULT_FIRST_MESSAGE_TIMEOUT_S = 10.0
# Between messages a trainer may wait for a whole generation (or a weight sync): minutes.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# Private-use close code, after HTTP's 408 Request Timeout.
IDLE_CLOSE_CODE = 4408

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionLimits:
    """How long the server waits for a client's messages before closing its WebSocket.

    Attributes:
        first_message_s: from the server's accept to the client's first message.
        idle_s: from each answer (or message) to the client's next message.
    """

    first_message_s: float = DEFAULT_FIRST_MESSAGE_TIMEOUT_S
    idle_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("first_message_s", "idle_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class SessionDeadlines:
    """Close a WebSocket whose client stays silent past its deadline (close code 4408).

    Closing the socket makes OpenEnv's own handler release the slot, once. Not OpenEnv's
    ``ConcurrencyConfig.session_timeout``: openenv-core 0.3.0's reaper frees the slot but leaves
    the socket open and playing outside the count, counts only reset and step as activity, and
    looks at most every 5 s. No per-address limit: behind the Spaces proxy every client has the
    proxy's address, and a trainer legitimately opens many sessions.
    """

    def __init__(self, app: ASGIApp, limits: SessionLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket" or scope["path"] != "/ws":  # /ws/ui holds no session
            await self.app(scope, receive, send)
            return
        calls = 0
        closed = False

        async def timed_receive() -> Message:
            nonlocal calls, closed
            calls += 1
            if calls == 1 or closed:  # the handshake's websocket.connect comes at once
                return await receive()
            limit = self.limits.first_message_s if calls == 2 else self.limits.idle_s
            try:
                async with asyncio.timeout(limit):  # cancelling receive() loses no message
                    return await receive()
            except TimeoutError:
                closed = True
            _log.info("closed a /ws session: no message within %g s", limit)
            with contextlib.suppress(OSError):  # the client may have gone at the same moment
                await send(
                    {
                        "type": "websocket.close",
                        "code": IDLE_CLOSE_CODE,
                        "reason": f"no message within {limit:g} s",
                    }
                )
            return {"type": "websocket.disconnect", "code": IDLE_CLOSE_CODE}

        async def guarded_send(message: Message) -> None:
            if not closed:  # after our close, OpenEnv's own close has nothing left to do
                await send(message)

        await self.app(scope, timed_receive, guarded_send)


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
