"""FastAPI app serving ``WordleEnvironment`` over OpenEnv's HTTP and WebSocket protocol."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect

from wordle_env.models import WordleAction, WordleObservation
from wordle_env.server.environment import WordleEnvironment
from wordle_env.server.errors import install_error_handlers
from wordle_env.server.sessions import NoMcpSessions, SessionDeadlines, SessionLimits
from wordle_env.words import load_word_lists

__all__ = ["DEFAULT_MAX_CONCURRENT_ENVS", "create_wordle_app"]

DEFAULT_MAX_CONCURRENT_ENVS = 256


class _QuietDisconnect:
    """Drop the WebSocketDisconnect raised after a session has ended.

    openenv-core 0.3.0 closes the socket once more after the client has gone (the session is
    already released by then) and uvicorn would log a traceback for every finished session.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        with contextlib.suppress(WebSocketDisconnect):
            await self.app(scope, receive, send)


def create_wordle_app(
    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
    limits: SessionLimits | None = None,
) -> FastAPI:
    """Build the app; each ``/ws`` connection gets its own game, up to ``max_concurrent_envs``.

    A connection beyond the cap is answered with a ``CAPACITY_REACHED`` error frame; a silent one
    is closed after ``limits`` (defaults: 10 s for the first message, 300 s between messages), so
    idle connections cannot keep the cap filled.
    """
    if max_concurrent_envs < 1:
        raise ValueError(f"max_concurrent_envs must be >= 1, got {max_concurrent_envs}")
    load_word_lists()  # read once, before the first session, instead of inside one
    app = create_app(
        WordleEnvironment,
        WordleAction,
        WordleObservation,
        env_name="wordle_env",
        max_concurrent_envs=max_concurrent_envs,
    )
    install_error_handlers(app)
    # Outermost last: /mcp is answered before anything else, deadlines wrap OpenEnv's handler.
    app.add_middleware(_QuietDisconnect)
    app.add_middleware(SessionDeadlines, limits=limits or SessionLimits())
    app.add_middleware(NoMcpSessions)
    return app
