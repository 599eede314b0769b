"""The server's settings, read from the environment (Space variables) by its entry points."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from wordle_env.server.sessions import (
    DEFAULT_FIRST_MESSAGE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_LIFETIME_S,
    DEFAULT_MAX_STEPS,
    SessionLimits,
)

__all__ = ["DEFAULT_MAX_CONCURRENT_ENVS", "ServerSettings", "SettingError"]

DEFAULT_MAX_CONCURRENT_ENVS = 256
# OpenEnv's own spelling of "on" for ENABLE_WEB_INTERFACE; anything else it reads as "off".
_ON = ("true", "1", "yes")
_OFF = ("false", "0", "no", "")
_T = TypeVar("_T", int, float, bool)


class SettingError(ValueError):
    """A setting's value is refused; the message is one line naming the variable and the rule."""


@dataclass(frozen=True)
class ServerSettings:
    """What the environment variables configure.

    Attributes:
        max_concurrent_envs: ``MAX_CONCURRENT_ENVS``, the session cap.
        limits: ``SESSION_FIRST_MESSAGE_TIMEOUT_S``, ``SESSION_IDLE_TIMEOUT_S``,
            ``SESSION_LIFETIME_S`` and ``SESSION_MAX_STEPS``.
        web: ``ENABLE_WEB_INTERFACE``, OpenEnv's page at ``/web`` (``/`` redirects to it).
        api_key: ``ENV_API_KEY`` (a Space secret): when set, ``/ws``, ``/reset`` and ``/step``
            need ``Authorization: Bearer <key>``.
    """

    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS
    limits: SessionLimits = field(default_factory=SessionLimits)
    web: bool = False
    api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ServerSettings:
        """Read every setting; an unset one keeps its default, a bad one is a ``SettingError``."""

        def read(name: str, default: _T, parse: Callable[[str], _T]) -> _T:
            raw = environ.get(name)
            if raw is None:
                return default
            try:
                return parse(raw)
            except ValueError as exc:
                raise SettingError(f"{name} must be {exc}, got {raw!r}") from None

        return cls(
            max_concurrent_envs=read("MAX_CONCURRENT_ENVS", DEFAULT_MAX_CONCURRENT_ENVS, _count),
            limits=SessionLimits(
                first_message_s=read(
                    "SESSION_FIRST_MESSAGE_TIMEOUT_S", DEFAULT_FIRST_MESSAGE_TIMEOUT_S, _seconds
                ),
                idle_s=read("SESSION_IDLE_TIMEOUT_S", DEFAULT_IDLE_TIMEOUT_S, _seconds),
                lifetime_s=read("SESSION_LIFETIME_S", DEFAULT_LIFETIME_S, _seconds),
                max_steps=read("SESSION_MAX_STEPS", DEFAULT_MAX_STEPS, _count),
            ),
            web=read("ENABLE_WEB_INTERFACE", False, _switch),
            api_key=_key(environ.get("ENV_API_KEY", "")),
        )


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


def _key(raw: str) -> str | None:
    """An empty value means no key; a bad one is refused without echoing it (it is a secret)."""
    if raw and (len(raw) < 16 or not raw.isprintable() or " " in raw):
        raise SettingError("ENV_API_KEY must be at least 16 printable characters without spaces")
    return raw or None


def _switch(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"one of {', '.join(_ON + _OFF[:-1])}")
    return value in _ON
