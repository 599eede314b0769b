"""Test-only vLLM middleware (`-- --middleware stall_pause.StallAfterPause`, with this folder on
PYTHONPATH): while the file named by DELTASYNC_TEST_STALL_FILE exists, vLLM's engine client
returns from `pause_generation` only after the seconds written in it, as a sync route stuck
inside its pause would. Production code has no such hook; this wraps vLLM's engine client in the
server process from the outside."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any


class StallAfterPause:
    def __init__(self, app: Any):
        self.app = app
        self.patched = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if not self.patched and engine is not None:
            _stall_pauses(engine, Path(os.environ["DELTASYNC_TEST_STALL_FILE"]))
            self.patched = True
        await self.app(scope, receive, send)


def _stall_pauses(engine: Any, flag: Path) -> None:
    pause = engine.pause_generation

    async def pause_generation(*args: Any, **kwargs: Any) -> None:
        await pause(*args, **kwargs)
        if flag.exists():
            await asyncio.sleep(float(flag.read_text()))

    engine.pause_generation = pause_generation
