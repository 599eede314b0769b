"""Wire models, field for field those of OpenEnv's TextArena env, so its clients work unchanged."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from wordle_env.game import NUM_GUESSES

__all__ = [
    "ENV_ID",
    "MAX_EPISODE_ID_CHARS",
    "MAX_MESSAGE_CHARS",
    "InvalidResetError",
    "WordleAction",
    "WordleMessage",
    "WordleObservation",
    "WordleResetOptions",
    "WordleState",
    "parse_reset_options",
]

ENV_ID = "Wordle-v0"
# A guess is "[crane]"; the cap only bounds what one message can add to the transcript.
MAX_MESSAGE_CHARS = 256
_ASCII = r"^[\x00-\x7f]*$"
# OpenEnv's HTTP ``ResetRequest`` caps ``episode_id`` at 255; the WebSocket path gets the same cap.
MAX_EPISODE_ID_CHARS = 255
_MAX_SEED = 2**64 - 1
_MAX_ERRORS = 3  # a refusal names at most this many problems, each loc part at most 40 chars


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


class InvalidResetError(ValueError):
    """Reset options refused before anything changed; the message is one bounded line.

    A ``ValueError`` so OpenEnv's WebSocket loop answers it as an ``EXECUTION_ERROR`` frame; the
    HTTP app maps it to 422 (``wordle_env.server.errors``).
    """


class WordleResetOptions(BaseModel):
    """What ``reset`` accepts, over HTTP and WebSocket alike; anything else is refused.

    Strict types: a seed of ``"7"``, ``7.0``, ``true`` or ``1e400`` (JSON's infinity) is not an
    integer. ``word`` is only length-checked here; the environment checks it against its words.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: StrictInt | None = Field(default=None, ge=0, le=_MAX_SEED)
    episode_id: StrictStr | None = Field(default=None, max_length=MAX_EPISODE_ID_CHARS)
    word: StrictStr | None = Field(default=None, min_length=5, max_length=5)


def parse_reset_options(raw: dict[str, Any]) -> WordleResetOptions:
    """Validate reset options; raise ``InvalidResetError`` naming each bad option, not its value.

    The value is left out on purpose: it may be 100,000 characters long or not printable.
    """
    try:
        return WordleResetOptions.model_validate(raw)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(part)[:40] for part in error['loc'])}: {error['msg']}"
            for error in exc.errors()[:_MAX_ERRORS]
        ]
        known = ", ".join(WordleResetOptions.model_fields)
        raise InvalidResetError(
            f"invalid reset options ({'; '.join(problems)}); known options: {known}"
        ) from None
