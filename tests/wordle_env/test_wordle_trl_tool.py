"""The trainer's Wordle tool (TRL `environment_factory` object) against the real server."""

from __future__ import annotations

import inspect
import pickle

from trainer.envs.sessions import OpenEnvTextTool, WordleTool


def _tools(cls: type) -> list[str]:
    """What TRL exposes as tools: public functions other than reset and get_reward."""
    return sorted(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    )


def test_only_the_game_moves_are_tools():
    assert _tools(WordleTool) == ["guess"]
    assert _tools(OpenEnvTextTool) == ["act"]


def test_a_won_game_through_the_tool(server_url):
    env = pickle.loads(pickle.dumps(WordleTool(base_url=server_url)))
    intro = env.reset(word="crane")
    assert "You are Playing Wordle" in intro
    first = env.guess("slate")
    assert "You submitted [slate]" in first and "You are Playing" not in first  # only what is new
    # scored after every guess: the partial credit the game would pay now (slate vs crane:
    # A and E green, (2 + 0.5 * 0) / 5), read without get_reward(), which ends the rollout
    assert env.reward == 0.4 and not env.done
    env.guess("cream")  # C R E A M vs crane: C R green, E A yellow
    assert env.reward == (2 + 0.5 * 2) / 5 and not env.done
    env.guess("crane")
    assert env.get_reward() == 1.0 and env.done
    assert env.guess("crane") == "The game is over."


def test_invalid_move_scores_zero(server_url):
    env = WordleTool(base_url=server_url)
    env.reset(word="crane")
    env.guess("slate")
    text = env.guess("zzzzz")  # after a scored guess: the invalid move still scores 0
    assert "You attempted an invalid move" in text and env.get_reward() == 0.0


def test_generic_tool_speaks_the_textarena_format(server_url):
    env = OpenEnvTextTool(base_url=server_url)
    env.reset(word="crane")
    assert "Feedback" in env.act("[crane]") or env.done
    assert env.get_reward() == 1.0
