"""Wire models, field for field those of OpenEnv's TextArena env, so its clients work unchanged."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field

from wordle_env.game import NUM_GUESSES

__all__ = [
    "ENV_ID",
    "MAX_MESSAGE_CHARS",
    "WordleAction",
    "WordleMessage",
    "WordleObservation",
    "WordleState",
]

ENV_ID = "Wordle-v0"
# A guess is "[crane]"; the cap only bounds what one message can add to the transcript.
MAX_MESSAGE_CHARS = 256
_ASCII = r"^[\x00-\x7f]*$"


class WordleAction(Action):
    """One player message, e.g. ``{"message": "[crane]"}``; a bare word is wrapped in brackets."""

    # Built-in constraints only: OpenEnv 0.3.0 cannot serialize a custom validator's exception
    # into its error frame and drops the session instead.
    message: str = Field(max_length=MAX_MESSAGE_CHARS, pattern=_ASCII)


class WordleMessage(BaseModel):
    """A transcript message; Wordle sends one, from the game (-1), holding the whole transcript."""

    model_config = ConfigDict(extra="forbid")

    sender_id: int
    content: str
    category: str


class WordleObservation(Observation):
    """TextArena observation: ``messages[0].content`` is the cumulative transcript.

    ``info["reward_signals"]`` carries the per-step signals (``wordle.greens``, ``wordle.yellows``,
    ``wordle.repetitions``, ``wordle.correct``); ``metadata`` holds them too but, like all metadata,
    stays on the server.
    """

    prompt: str
    messages: list[WordleMessage] = Field(default_factory=list)
    current_player_id: int = 0
    legal_players: list[int] = Field(default_factory=list)
    info: dict[str, Any] = Field(default_factory=dict)


class WordleState(State):
    """TextArena state fields; ``raw_state`` has the guesses, plus the secret once the game ends."""

    env_id: str = ENV_ID
    num_players: int = 1
    max_turns: int | None = NUM_GUESSES
    turn: int = 0
    last_reward: float = 0.0
    last_info: dict[str, Any] = Field(default_factory=dict)
    raw_state: dict[str, Any] = Field(default_factory=dict)
