"""OpenEnv ``Environment`` holding one Wordle game per WebSocket session."""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from wordle_env.game import PROMPT, WordleGame
from wordle_env.models import (
    ENV_ID,
    InvalidResetError,
    WordleAction,
    WordleMessage,
    WordleObservation,
    WordleResetOptions,
    WordleState,
    parse_reset_options,
)
from wordle_env.words import load_word_lists

__all__ = ["WordleEnvironment"]

# OpenEnv's TextArena server sends the stripped reset transcript as the prompt on reset (and the
# env id once a guess has been scored); the instructions are the useful constant.
_PROMPT = f"[GAME] {PROMPT}".strip()
_NO_GAME = "No game in progress. Send reset before step."
_GAME_OVER = "The game is over. Send reset to start a new game."


class WordleEnvironment(Environment[WordleAction, WordleObservation, WordleState]):
    """TextArena ``Wordle-v0`` behind the OpenEnv API; sessions share only the read-only words."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._words = load_word_lists()
        self._game: WordleGame | None = None
        self._state = WordleState()

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        word: str | None = None,
        **options: Any,
    ) -> WordleObservation:
        """Start a game; ``seed`` picks the secret reproducibly, ``word`` sets it (for tests).

        Every option is checked before the current game is touched, so a refused reset leaves the
        session as it was (``InvalidResetError``, a ``ValueError``).
        """
        parsed = parse_reset_options(
            {"seed": seed, "episode_id": episode_id, "word": word, **options}
        )
        self._game = WordleGame(self._pick_secret(parsed), self._words.guesses)
        self._state = WordleState(episode_id=parsed.episode_id or str(uuid4()))
        self._sync_state({})
        return self._observation(0.0, {}, {})

    def step(
        self, action: WordleAction, timeout_s: float | None = None, **kwargs: Any
    ) -> WordleObservation:
        """Play one message; before reset or after the end, answer done with an ``info`` error."""
        if not isinstance(action, WordleAction):
            raise TypeError(f"expected WordleAction, got {type(action).__name__}")
        game = self._game
        if game is None:
            return WordleObservation(
                prompt=_PROMPT,
                messages=[_transcript(f"\n[GAME] {_NO_GAME}")],
                legal_players=[0],
                info={"error": _NO_GAME},
                reward=0.0,
                done=True,
            )
        if game.done:
            # Keep the final reward so clients that read the latest reward still see the outcome.
            return self._observation(game.reward, {"error": _GAME_OVER}, {})
        turn = game.play(action.message)
        self._state.step_count += 1
        if turn.invalid_reason is None or turn.done:  # a warning costs no turn in TextArena
            self._state.turn += 1
        info = {"reward_signals": turn.signals}
        self._sync_state(info)
        return self._observation(turn.reward, info, {"reward_signals": turn.signals})

    @property
    def state(self) -> WordleState:
        """Episode id, counters and the game so far (the secret only once the game is over)."""
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        """Describe the env for OpenEnv's ``/metadata`` route and web UI."""
        return EnvironmentMetadata(
            name="wordle_env",
            description="Wordle in TextArena's Wordle-v0 format (G/Y/X feedback, 6 guesses).",
            version="0.1.0",
        )

    def _pick_secret(self, options: WordleResetOptions) -> str:
        if options.word is not None:
            word = options.word.lower()
            if word not in self._words.guesses:
                raise InvalidResetError(
                    f"invalid reset options (word: {options.word!r} is not an allowed guess)"
                )
            return word
        return random.Random(options.seed).choice(self._words.answers)

    def _sync_state(self, info: dict[str, Any]) -> None:
        game = self._game
        assert game is not None  # only called with a game in progress
        raw: dict[str, Any] = {
            "guesses": [[guess, feedback] for guess, feedback in game.history],
            "done": game.done,
            "reason": game.reason,
        }
        if game.done:
            raw["secret_word"] = game.secret
        self._state.last_reward = game.reward
        self._state.last_info = info
        self._state.raw_state = raw

    def _observation(
        self, reward: float, info: dict[str, Any], metadata: dict[str, Any]
    ) -> WordleObservation:
        game = self._game
        assert game is not None  # only called with a game in progress
        return WordleObservation(
            prompt=_PROMPT,
            messages=[_transcript(game.transcript)],
            legal_players=[0],
            info=info,
            reward=reward,
            done=game.done,
            metadata={"env_id": ENV_ID, "turn": self._state.turn, **metadata},
        )


def _transcript(content: str) -> WordleMessage:
    return WordleMessage(sender_id=-1, content=content, category="MESSAGE")
