"""Test-only vLLM middlewares (`-- --middleware pause_hooks.StallAfterPause` or
`pause_hooks.HoldPause`, with this folder on PYTHONPATH) that slow vLLM's engine client's
`pause_generation` from the outside, as a slow apply or a sync stuck inside its pause would.
Inert while their flag file is absent; production code has no such hook.

- `StallAfterPause`: while DELTASYNC_TEST_STALL_FILE exists, returns only after the seconds
  written in it;
- `HoldPause`: while DELTASYNC_TEST_HOLD_FILE exists, returns once it is removed (at most
  `HOLD_MAX_S` later).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HOLD_MAX_S = 60.0


class _PausePatch:
    """Wraps the engine client's `pause_generation` once it exists (the first request)."""

    def __init__(self, app: Any):
        self.app = app
        self.patched = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if not self.patched and engine is not None:
            pause = engine.pause_generation

            async def pause_generation(*args: Any, **kwargs: Any) -> None:
                await pause(*args, **kwargs)
                await self.after_pause()

            engine.pause_generation = pause_generation
            self.patched = True
        await self.app(scope, receive, send)

    after_pause: Callable[[], Awaitable[None]]


class StallAfterPause(_PausePatch):
    async def after_pause(self) -> None:
        flag = Path(os.environ["DELTASYNC_TEST_STALL_FILE"])
        if flag.exists():
            await asyncio.sleep(float(flag.read_text()))


class HoldPause(_PausePatch):
    async def after_pause(self) -> None:
        flag = Path(os.environ["DELTASYNC_TEST_HOLD_FILE"])
        deadline = time.monotonic() + HOLD_MAX_S
        while flag.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
