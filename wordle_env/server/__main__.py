"""Run the Wordle server.

    python -m wordle_env.server                            # 127.0.0.1:8002, local mode
    MAX_CONCURRENT_ENVS=512 python -m wordle_env.server --host 0.0.0.0 --port 8000

Settings come from the environment (Space variables):
    MAX_CONCURRENT_ENVS               session cap (default 256)
    SESSION_FIRST_MESSAGE_TIMEOUT_S   a new /ws connection must send within this (default 10)
    SESSION_IDLE_TIMEOUT_S            a session silent this long is closed (default 300)
    ENABLE_WEB_INTERFACE=true         adds OpenEnv's Gradio page at /web
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from wordle_env.server.app import DEFAULT_MAX_CONCURRENT_ENVS, create_wordle_app
from wordle_env.server.sessions import (
    DEFAULT_FIRST_MESSAGE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    SessionLimits,
)

# Frames are tiny (a guess is capped at 256 characters); refuse megabyte frames outright.
_WS_MAX_FRAME_BYTES = 1 << 20
_T = TypeVar("_T", int, float)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wordle_env.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    capacity = _setting(parser, "MAX_CONCURRENT_ENVS", DEFAULT_MAX_CONCURRENT_ENVS, _count)
    limits = SessionLimits(
        first_message_s=_setting(
            parser, "SESSION_FIRST_MESSAGE_TIMEOUT_S", DEFAULT_FIRST_MESSAGE_TIMEOUT_S, _seconds
        ),
        idle_s=_setting(parser, "SESSION_IDLE_TIMEOUT_S", DEFAULT_IDLE_TIMEOUT_S, _seconds),
    )
    app = create_wordle_app(capacity, limits)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=_log_config(args.log_level),
        ws_max_size=_WS_MAX_FRAME_BYTES,
    )


def _setting(
    parser: argparse.ArgumentParser, name: str, default: _T, parse: Callable[[str], _T]
) -> _T:
    """Read one environment setting; a bad value is a one-line usage error (exit 2)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        parser.error(f"{name} must be {exc}, got {raw!r}")


def _count(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError("a positive integer")
    return int(raw)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError("a positive number of seconds")
    return value


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
