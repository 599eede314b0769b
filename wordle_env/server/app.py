"""The Wordle server in OpenEnv's layout: the app factory, a module-level ``app`` and ``main``.

    python -m wordle_env.server                              # 127.0.0.1:8002, local mode
    python -m wordle_env.server --host 0.0.0.0 --port 8000   # the Space
    uv run --project wordle_env server                       # OpenEnv's [project.scripts] entry
    uvicorn wordle_env.server.app:app --port 8000 --ws-max-size 1048576

Settings come from the environment (Space variables):
    MAX_CONCURRENT_ENVS               session cap (default 256)
    SESSION_FIRST_MESSAGE_TIMEOUT_S   a new /ws connection must send within this (default 10)
    SESSION_IDLE_TIMEOUT_S            a session that plays no reset or step this long is closed
                                      (default 300)
    SESSION_LIFETIME_S                a session's longest life (default 3600)
    SESSION_MAX_STEPS                 resets and steps one session may play (default 1000)
    ENV_API_KEY                       when set, /ws, /reset and /step need "Bearer <key>"
    ENABLE_WEB_INTERFACE=true         OpenEnv's page at /web, and / redirects there (default off)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
from typing import Any

import uvicorn
from fastapi import FastAPI
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.web_interface import create_web_interface_app
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect
from uvicorn.config import LOGGING_CONFIG

from wordle_env.models import WordleAction, WordleObservation
from wordle_env.server.access import BoundedBodies, RequireApiKey
from wordle_env.server.environment import WordleEnvironment
from wordle_env.server.errors import install_error_handlers
from wordle_env.server.sessions import NoMcpSessions, SessionDeadlines, SessionLimits
from wordle_env.server.settings import DEFAULT_MAX_CONCURRENT_ENVS, ServerSettings, SettingError
from wordle_env.server.web import NoUploads, WebStepCheck
from wordle_env.words import load_word_lists

__all__ = ["create_wordle_app", "main"]

# Frames are tiny (a guess is capped at 256 characters); refuse megabyte frames outright.
_WS_MAX_FRAME_BYTES = 1 << 20


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
    *,
    web: bool = False,
    api_key: str | None = None,
) -> FastAPI:
    """Build the app; each ``/ws`` connection gets its own game, up to ``max_concurrent_envs``.

    A connection beyond the cap is answered with a ``CAPACITY_REACHED`` error frame; one that
    does not play is closed by ``limits`` (defaults: 10 s to the first reset, 300 s between
    steps, 16 invalid frames in a row, an hour in all), so connections that do not play cannot
    keep the cap filled. ``web`` adds OpenEnv's Gradio page at ``/web`` (``/`` redirects there);
    it plays one game shared by its visitors, outside the cap. ``api_key`` closes the play
    routes to callers without it.
    """
    if max_concurrent_envs < 1:
        raise ValueError(f"max_concurrent_envs must be >= 1, got {max_concurrent_envs}")
    load_word_lists()  # read once, before the first session, instead of inside one
    create, named = (
        (create_web_interface_app, {"env_name": "wordle_env"}) if web else (create_fastapi_app, {})
    )
    app = create(
        WordleEnvironment,
        WordleAction,
        WordleObservation,
        max_concurrent_envs=max_concurrent_envs,
        **named,
    )
    install_error_handlers(app)
    # Outermost last: uploads and /mcp are answered before anything else, deadlines wrap
    # OpenEnv's handler.
    app.add_middleware(_QuietDisconnect)
    app.add_middleware(SessionDeadlines, limits=limits or SessionLimits())
    if web:
        app.add_middleware(WebStepCheck)
    app.add_middleware(BoundedBodies)
    app.add_middleware(NoMcpSessions)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(NoUploads)
    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the app on ``--host``/``--port``; a bad setting is a one-line usage error (exit 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m wordle_env.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    try:
        settings = ServerSettings.from_environ(os.environ)
    except SettingError as exc:
        parser.error(str(exc))
    uvicorn.run(
        _app_from(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=_log_config(args.log_level),
        ws_max_size=_WS_MAX_FRAME_BYTES,
    )


def __getattr__(name: str) -> FastAPI:
    """``app`` for ``uvicorn wordle_env.server.app:app``, built from the settings on first use.

    Built on access rather than at import, so that importing ``create_wordle_app`` neither reads
    the environment nor builds a server.
    """
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    app = _app_from(ServerSettings.from_environ(os.environ))
    globals()["app"] = app
    return app


def _app_from(settings: ServerSettings) -> FastAPI:
    return create_wordle_app(
        settings.max_concurrent_envs, settings.limits, web=settings.web, api_key=settings.api_key
    )


def _log_config(level: str) -> dict[str, Any]:
    """Uvicorn's logging plus ``wordle_env``'s one-line refusals and idle closes, same format."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["wordle_env"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


if __name__ == "__main__":
    main()
