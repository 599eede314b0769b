"""An MCP-tool OpenEnv environment for the trainer's tests (`from mcp_env import ...`), built the
way OpenEnv's own `echo_env` is: an `MCPEnvironment` around a FastMCP server, served by
`create_app` with `CallToolAction` / `CallToolObservation`. `--env URL` must play it with zero
code: one TRL tool per MCP tool, typed from the tools' input schemas.

Four tools with typed arguments (`add` takes two integers). Each episode has a task chosen by
the seed, with arguments that vary by seed: a sum (`add`), a shout (`shout`) or a color to pick
(`pick`), in turn (seed 0: `add(2, 3)`, seed 1: `shout("hello")`). A call of the task's tool
that the server accepts ends the episode: the task's reward (1.0; 0.5 for a shout) when every
argument is right, half of it plus that half's share per right argument otherwise (so a model
that picks the right tool learns before it copies the arguments right); any other call scores
0.0 and the episode goes on. Every call that reaches the server is recorded with its arguments
as they arrived (`ToolEnvironment.calls`).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Literal

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import EnvironmentMetadata, Observation, State
from say_env import _QuietDisconnect

WORDS = ("hello", "world", "green", "quiet", "storm", "maple", "river", "candy", "noble", "tiger")
COLORS = ("red", "green", "blue")
DESCRIPTION = "Solve small tasks with the tools."


def task(seed: int) -> tuple[str, str, dict[str, Any], float]:
    """The episode's (instruction, tool, arguments, reward when solved) for a reset seed."""
    rng = random.Random(seed)
    if seed % 3 == 0:
        a, b = (2, 3) if seed == 0 else (rng.randint(0, 9), rng.randint(0, 9))
        return f"Add {a} and {b}.", "add", {"a": a, "b": b}, 1.0
    if seed % 3 == 1:
        word = "hello" if seed == 1 else rng.choice(WORDS)
        return f"Shout {word}.", "shout", {"text": word}, 0.5
    color = rng.choice(COLORS)
    return f"Pick {color}.", "pick", {"color": color}, 1.0


class TaskObservation(Observation):
    task: str


def _tools() -> FastMCP:
    mcp = FastMCP("tool_env")

    @mcp.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first addend
            b: the second addend
        """
        return a + b

    @mcp.tool
    def shout(text: str, loud: bool = True) -> str:
        """Repeat a text in capitals.

        Args:
            text: what to shout
            loud: add an exclamation mark
        """
        return text.upper() + ("!" if loud else "")

    @mcp.tool
    def pick(color: Literal["red", "green", "blue"]) -> str:
        """Pick a color."""
        return color

    @mcp.tool
    def mean(values: list[float], digits: int | None = None) -> float:
        """The mean of some numbers.

        Args:
            values: the numbers
            digits: round to this many digits
        """
        result = sum(values) / len(values)
        return result if digits is None else round(result, digits)

    return mcp


class ToolEnvironment(MCPEnvironment):
    """One task per episode, scored when its tool is called."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []  # (tool, arguments) as they arrived

    def __init__(self) -> None:
        super().__init__(_tools())
        self._task = task(0)
        self._done = False
        self._state = State()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> TaskObservation:
        self._task = task(seed or 0)
        self._done = False
        self._state = State(episode_id=episode_id, step_count=0)
        return TaskObservation(task=self._task[0], reward=0.0)

    def _scored(self, action: Any, observation: Observation) -> Observation:
        if not isinstance(action, CallToolAction):
            return observation
        ToolEnvironment.calls.append((action.tool_name, dict(action.arguments)))
        _, tool, arguments, reward = self._task
        accepted = action.tool_name == tool and getattr(observation, "error", None) is None
        right = sum(action.arguments.get(k) == v for k, v in arguments.items())
        self._done = self._done or accepted
        observation.reward = reward * (1 + right / len(arguments)) / 2 if accepted else 0.0
        observation.done = self._done
        return observation

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(
        self, action: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        self._state.step_count += 1
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._scored(action, observation)

    def _step_impl(self, action: Any, timeout_s: float | None = None, **_: Any) -> Observation:
        return Observation(reward=0.0, metadata={"error": "only MCP tool calls"})

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="tool_env", description=DESCRIPTION, version="1.0")


def create_mcp_app(environment: type[Environment] = ToolEnvironment):
    app = create_app(
        environment,
        CallToolAction,
        CallToolObservation,
        env_name="tool_env",
        max_concurrent_envs=64,
    )
    return _QuietDisconnect(app)
