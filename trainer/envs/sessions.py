"""Environments for TRL's `environment_factory`: any OpenEnv server as a text tool, and Wordle.

TRL creates one object per rollout in its (spawned) rollout worker, calls `reset(**row)` and
appends the returned text to the prompt, exposes the other public methods as tools (schema from
type hints and Google docstrings) and reads `get_reward()`. Objects must be picklable, so they
are built with `functools.partial(Class, base_url=...)`.

Servers need no code: `--env URL` plays TextArena-shaped servers through `OpenEnvTextTool` and
MCP-tool servers through one tool per server tool (`trainer.envs.mcp_tools`). For any other action
shape, subclass `OpenEnvSession`: override `_action` (tool argument -> action dict) and `_text`
(observation dict -> text for the model), set `prompt` (the instruction each rollout starts
with), and add one public method per tool, with the name, type hints and docstring the model
should see, that returns `self._step(...)`. Every public method except `reset` and `get_reward`
becomes a tool, so helpers stay private. `--env package.module:Class` trains on it without
touching this repository (`ENVIRONMENTS` holds the built-in names). See the README section "Use
another OpenEnv environment".
"""

from __future__ import annotations

import atexit
import contextlib
import re
import threading
from typing import Any, ClassVar

__all__ = [
    "ENVIRONMENTS",
    "WORDLE_WORDS",
    "OpenEnvSession",
    "OpenEnvTextTool",
    "WordleTool",
]

_OPEN: set[Any] = set()  # sync clients of this process whose session is open
_OPEN_LOCK = threading.Lock()  # TRL resets, steps and scores sessions from a thread pool


def _close_client(client: Any) -> None:
    """Close one session with a close frame; the server may be gone, which needs nothing."""
    with _OPEN_LOCK:
        _OPEN.discard(client)
    with contextlib.suppress(Exception):
        client.close()


@atexit.register
def _close_open_sessions() -> None:
    """Close what is still open when the process ends (a rollout cut off by an exception or by
    TRL's worker stopping): a dropped socket makes the server log a traceback per session."""
    with _OPEN_LOCK:
        clients = list(_OPEN)
    for client in clients:
        _close_client(client)


class OpenEnvSession:
    """One OpenEnv session per rollout (WebSocket), with no tools of its own.

    The default mapping fits TextArena-style servers: the action is `{"message": text}` and the
    observation's `messages[0].content` is a transcript that only grows, so each step returns the
    part that is new.

    Attributes:
        prompt: the user message of every rollout (the text `reset` returns is appended to it);
            it should name the tools the subclass defines.
    """

    prompt = "Play the game with your tools until it is over."
    examples: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Values a tool argument of this name may take, for the format warm-up's synthetic calls
    (`trainer.envs.warmup`); an argument not named here gets a value drawn from its JSON schema."""
    reward_source: ClassVar[str | None] = None
    """What the reward is, in the trainer's log and report (None: the server's reward of the
    episode's last step, or `Class.get_reward()` when a subclass overrides it)."""

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url
        self.api_key = api_key
        self._client: Any = None
        self._seen = ""
        self.reward = 0.0
        self.done = False

    def _action(self, text: str) -> dict[str, Any]:
        return {"message": text}

    def _text(self, observation: dict[str, Any]) -> str:
        messages = observation.get("messages") or []
        transcript = messages[0]["content"] if messages else str(observation.get("prompt", ""))
        grew = transcript.startswith(self._seen)
        new = transcript[len(self._seen) :] if grew else transcript
        self._seen = transcript
        return new

    def reset(self, **row: Any) -> str:
        self._close()
        self._seen, self.reward, self.done = "", 0.0, False
        try:
            self._open()
            result = self._client.reset(**{k: v for k, v in row.items() if k in ("seed", "word")})
        except BaseException:
            self._close()
            raise
        return self._text(result.observation)

    def _open(self) -> None:
        from .client import env_client

        self._client = env_client(self.base_url, self.api_key).sync()
        with _OPEN_LOCK:
            _OPEN.add(self._client)
        self._client.connect()

    def _step(self, text: str) -> str:
        if self.done:
            return "The game is over."
        result = self._step_result(self._action(text))
        self.reward = float(result.reward or 0.0)
        self.done = bool(result.done)
        if self.done:
            self._close()
        return self._text(result.observation)

    def _step_result(self, action: dict[str, Any]) -> Any:
        """One step's result. The server's error reply (RuntimeError) leaves the session as it
        was; any other failure (a timeout, a dropped socket) leaves replies out of step with
        requests, so the session is closed and later calls are refused."""
        if self._client is None:
            raise RuntimeError("the environment session is closed")
        try:
            return self._client.step(action)
        except RuntimeError:
            raise
        except BaseException:
            self._close()
            raise

    def get_reward(self) -> float:
        """The rollout's reward. TRL asks once the rollout has ended, done or not (out of tool
        calls, an answer without one), so its session is closed now rather than left open in
        TRL's pool of sessions until this object's next reset; an override should call it."""
        self._close()
        return self.reward

    def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_client(client)

    def __getstate__(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "api_key": self.api_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["base_url"], state.get("api_key"))


class OpenEnvTextTool(OpenEnvSession):
    """Any TextArena-style OpenEnv server through one tool, `act`."""

    prompt = "Play the game: call the act tool with your message until the game is over."

    def act(self, message: str) -> str:
        """Send one message to the environment.

        Args:
            message: the text of the action.

        Returns:
            What the environment answered.
        """
        return self._step(message)


# Allowed guesses the format warm-up draws from, from good openers to poor ones (expected
# partial credit against a random secret from 0.24 for "stare" to 0.06 for "kudzu"): a small
# model learns a dozen words in a few hundred steps, and GRPO has better and worse ones to
# tell apart.
_WORDS = """
    stare raise crane cloth jazzy kudzu
"""
WORDLE_WORDS = tuple(_WORDS.split())
_FEEDBACK = re.compile(r"^[GYX](?: [GYX]){4}$", re.MULTILINE)


class WordleTool(OpenEnvSession):
    """Wordle with a `guess` tool, scored after every guess: the reward is what the game would
    pay if it ended now (1.0 for a win, else TextArena's partial credit of the last guess,
    (greens + 0.5 * yellows) / 5), and 0 after an invalid move. The server pays only at the end
    of a game; scoring every guess lets a rollout that stops early still tell GRPO how close it
    came (the partial credit other Wordle RL setups give per guess too)."""

    prompt = "Play Wordle. Call the guess tool with a five-letter word until you solve it."
    examples: ClassVar[dict[str, tuple[Any, ...]]] = {"guess": WORDLE_WORDS}
    reward_source = (
        "the game's score after the last guess (1.0 for a win, else (greens + 0.5 * yellows) "
        "/ 5, 0 after an invalid move)"
    )

    def guess(self, guess: str) -> str:
        """Guess the secret five-letter word.

        Args:
            guess: a five-letter English word, e.g. "crane".

        Returns:
            The feedback: G (right letter, right place), Y (in the word elsewhere), X (absent).
        """
        text = self._step(guess if guess.startswith("[") else f"[{guess.strip().lower()}]")
        if "You attempted an invalid move" in text:
            self.reward = 0.0
        elif not self.done and (scored := _FEEDBACK.findall(text)):
            marks = scored[-1].split()
            self.reward = (marks.count("G") + marks.count("Y") * 0.5) / len(marks)
        return text


# `--env` names of the trainer script (`openenv`: the server at --env-url, inspected first).
ENVIRONMENTS: dict[str, type[OpenEnvSession]] = {"wordle": WordleTool, "openenv": OpenEnvTextTool}
