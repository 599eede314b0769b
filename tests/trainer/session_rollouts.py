"""OpenEnv servers as users build them, and rollouts that end every way, for
`test_env_sessions_closed.py`.

`bare_mcp_app` / `bare_say_app`: the tests' MCP-tool and TextArena-style environments served by
OpenEnv's `create_app` alone (openenv-core 0.3.0 logs `Exception in ASGI application` for every
session that does not end with the server closing it). Run as a script, this module plays
rollouts against one of them through the trainer's own session code, as TRL's rollout worker
drives it (`reset`, tool calls, `get_reward`, the object pooled for the next rollout), then
stops with rollouts still in flight, as a worker that fails or is stopped does:

    python tests/trainer/session_rollouts.py mcp|say URL
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from openenv.core.env_server.http_server import create_app

UNREACHABLE = "http://127.0.0.1:9"  # the trainer's --env-url, unused when --env is a URL
LONG = "x" * 300  # over SayAction's 256 characters: the server answers VALIDATION_ERROR

# A rollout: the tool calls of its turns, as (tool, arguments); the seed picks the task.
# mcp (seed 0: `add(2, 3)` ends the episode)
MCP_ROLLOUTS = {
    "done": [("add", {"a": 2, "b": 3})],
    "early": [("shout", {"text": "hi"}), ("pick", {"color": "red"})],  # out of tool calls
    "no tool call": [],
    "tool error": [("pick", {"color": "purple"}), ("add", {"a": 1})],  # the server's, then TRL's
}
# say (one `act` ends the episode)
SAY_ROLLOUTS = {
    "done": [("act", {"message": "hello"})],
    "no tool call": [],
    "server error": [("act", {"message": LONG})],
}


def bare_mcp_app():
    from mcp_env import ToolEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    return create_app(
        ToolEnvironment, CallToolAction, CallToolObservation, "tool_env", max_concurrent_envs=64
    )


def bare_say_app():
    from say_env import SayAction, SayEnvironment, SayObservation

    return create_app(SayEnvironment, SayAction, SayObservation, "say_env", max_concurrent_envs=64)


def _play(session: Any, calls: list[tuple[str, dict[str, Any]]]) -> float:
    """One rollout as TRL plays it: reset, the tool calls (a failing one is counted and the
    rollout goes on), then the reward."""
    session.reset(seed=0)
    for tool, arguments in calls:
        with contextlib.suppress(RuntimeError, TypeError):
            getattr(session, tool)(**arguments)
    return session.get_reward()


async def _cut_off(factory: Any, count: int) -> None:
    """Rollouts reset and mid-game when the worker's loop ends with an error."""
    loop = asyncio.get_running_loop()
    sessions = [factory() for _ in range(count)]
    await asyncio.gather(
        *(loop.run_in_executor(None, lambda s=s: s.reset(seed=1)) for s in sessions)
    )
    tasks = [asyncio.create_task(asyncio.sleep(60)) for _ in sessions]  # their next model turn
    for task in tasks:
        task.cancel()
    raise RuntimeError("the rollout worker failed with rollouts in flight")


def main(kind: str, url: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from trainer.envs.spec import preflight, resolve

    spec = preflight(resolve(url, UNREACHABLE))  # the trainer's own inspection and pre-flight
    pool = [spec.factory(), spec.factory()]
    rollouts = MCP_ROLLOUTS if kind == "mcp" else SAY_ROLLOUTS
    left_open = []
    for round_ in range(2):  # the second round resets pooled sessions
        for i, (ending, calls) in enumerate(rollouts.items()):
            session = pool[i % len(pool)]
            reward = _play(session, calls)
            if session._client is not None:
                left_open.append(f"{ending} (round {round_}, reward {reward})")
    print(json.dumps({"left_open": left_open}), flush=True)
    asyncio.run(_cut_off(spec.factory, 3))


if __name__ == "__main__":
    main(*sys.argv[1:])
