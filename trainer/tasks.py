"""The built-in sanity task: a graded reward that even a tiny random model can climb.

Reward = the share of completion tokens that belong to a chosen set (default: the 26 lowercase
letters). A random model starts near |set|/vocab (~5 % for the tiny model), so most groups of
completions differ in reward and GRPO gets a signal from the first step; a rising mean reward
shows that learning and weight sync work end to end without an environment server. (A single
target token gives almost no signal: a random model almost never emits it.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["sanity_dataset", "sanity_reward", "token_share_reward"]

DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz"

PROMPTS = (
    "Write a short line.",
    "Say something.",
    "Continue the text.",
    "Reply briefly.",
)


def token_share_reward(
    completion_ids: list[list[int]], token_ids: frozenset[int], **_: object
) -> list[float]:
    """Fraction of each completion's tokens in `token_ids` (0.0 for an empty completion)."""
    return [sum(t in token_ids for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]


def sanity_reward(token_ids: frozenset[int]) -> Callable[..., list[float]]:
    """A picklable reward function for the rollout worker (it runs in a spawned process)."""
    return functools.partial(token_share_reward, token_ids=frozenset(token_ids))


def sanity_dataset(rows: int = 512):
    """Chat prompts for the sanity task."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]} for i in range(rows)]
    )
