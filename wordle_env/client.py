"""Typed WebSocket client for the Wordle server (async; call ``.sync()`` for blocking use).

    with WordleEnv(base_url="http://127.0.0.1:8002").sync() as env:
        result = env.reset(seed=7)
        result = env.step(WordleAction(message="[crane]"))
        print(result.observation.messages[0].content, result.reward, result.done)

OpenEnv's ``TextArenaEnv`` client and ``GenericEnvClient`` work against the same server.
"""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from wordle_env.models import WordleAction, WordleObservation, WordleState

__all__ = ["WordleEnv"]


class WordleEnv(EnvClient[WordleAction, WordleObservation, WordleState]):
    """One game session per connection; ``reset`` accepts ``seed``, ``episode_id`` and ``word``."""

    def _step_payload(self, action: WordleAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordleObservation]:
        observation = WordleObservation.model_validate(
            {**payload["observation"], "reward": payload.get("reward"), "done": payload["done"]}
        )
        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> WordleState:
        return WordleState.model_validate(payload)
