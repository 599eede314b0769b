"""A second OpenEnv environment for the trainer's tests (`from say_env import ...`): say the word
the game asks for. Built like `wordle_env` on OpenEnv's own classes and `create_app`, and
TextArena-shaped (action `{"message"}`, a transcript in `messages[0].content`), so `--env openenv`
plays it through the `act` tool. Reward 1.0 for the asked word, else 0.0; one step per episode.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field
from starlette.websockets import WebSocketDisconnect

WORDS = ("hello", "world")


class SayAction(Action):
    message: str = Field(max_length=256)


class SayObservation(Observation):
    prompt: str
    messages: list[dict[str, Any]] = Field(default_factory=list)


class SayEnvironment(Environment[SayAction, SayObservation, State]):
    """One episode: the game names a word (by seed); the reward says whether it was said."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    played: ClassVar[list[tuple[str, float]]] = []  # (word said, reward) of every step

    def __init__(self) -> None:
        super().__init__()
        self._target: str | None = None
        self._transcript = ""
        self._state = State()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> SayObservation:
        self._target = WORDS[(seed or 0) % len(WORDS)]
        self._transcript = f"\n[GAME] Say the word {self._target}."
        self._state = State(episode_id=episode_id, step_count=0)
        return self._observation(0.0, done=False)

    def step(self, action: SayAction, timeout_s: float | None = None, **_: Any) -> SayObservation:
        if self._target is None:
            return self._observation(0.0, done=True)
        said = action.message.strip().strip("[]\"' .").lower()
        reward = 1.0 if said == self._target else 0.0
        self._transcript += f"\n[GAME] You said {said!r}: reward {reward}."
        self._state.step_count += 1
        self._target = None
        SayEnvironment.played.append((said, reward))
        return self._observation(reward, done=True)

    @property
    def state(self) -> State:
        return self._state

    def _observation(self, reward: float, *, done: bool) -> SayObservation:
        return SayObservation(
            prompt="[GAME] Say the word.",
            messages=[{"sender_id": -1, "content": self._transcript, "category": "MESSAGE"}],
            reward=reward,
            done=done,
        )


def create_say_app():
    app = create_app(
        SayEnvironment, SayAction, SayObservation, env_name="say_env", max_concurrent_envs=64
    )

    return _QuietDisconnect(app)


class _QuietDisconnect:
    """openenv-core 0.3.0 closes a finished session's socket once more and uvicorn would log a
    traceback for it (wordle_env's app drops it the same way)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        with contextlib.suppress(WebSocketDisconnect):
            await self.app(scope, receive, send)


@contextlib.contextmanager
def serve(app, *, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port in a thread; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {port} did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
