"""What gets in: an API key on the play routes when one is set, and bounded request bodies."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from wordle_env.server.errors import refusal

__all__ = ["MAX_BODY_BYTES", "BoundedBodies", "RequireApiKey", "read_body", "replaying"]

# A guess is at most 256 characters and a reset a seed and a word: 16 KiB is far above any move.
MAX_BODY_BYTES = 16 * 1024
# The routes that play; health, metadata and schema stay open for the Hub and `openenv validate`.
PLAY_ROUTES = ("/ws", "/reset", "/step")
_BOUNDED = ("/reset", "/step", "/web/reset", "/web/step")


class RequireApiKey:
    """With ``ENV_API_KEY`` set, ``/ws``, ``/reset`` and ``/step`` need ``Bearer <key>``.

    A WebSocket without it is refused at the handshake (403), so it never holds a slot; HTTP
    gets 401. The key is compared in constant time and never logged.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"].rstrip("/") in PLAY_ROUTES:
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):
                if scope["type"] == "websocket":
                    await WebSocketClose(code=1008)(scope, receive, send)
                else:
                    reason = "missing or wrong API key (Authorization: Bearer <ENV_API_KEY>)"
                    await refusal(scope["method"], scope["path"], reason, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BoundedBodies:
    """Refuse a ``/reset`` or ``/step`` body over ``MAX_BODY_BYTES`` with 413, reading no more."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") not in _BOUNDED:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            problem = f"body missing or over {MAX_BODY_BYTES} bytes"
            await refusal(scope["method"], scope["path"], problem, 413)(scope, receive, send)
            return
        await self.app(scope, replaying(body, receive), send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None past ``MAX_BODY_BYTES`` (or if the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body already read, then the client's next messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
