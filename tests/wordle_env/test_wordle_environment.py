"""``WordleEnvironment`` in process: reset options, edge steps, state and action validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wordle_env import WordleAction
from wordle_env.models import MAX_EPISODE_ID_CHARS, MAX_MESSAGE_CHARS, InvalidResetError
from wordle_env.server import WordleEnvironment


def _secret(env: WordleEnvironment) -> str:
    env.step(WordleAction(message="[ab]"))
    env.step(WordleAction(message="[ab]"))  # second invalid move ends the game
    return env.state.raw_state["secret_word"]


def _secret_for(seed: int) -> str:
    env = WordleEnvironment()
    env.reset(seed=seed)
    return _secret(env)


def test_seeded_reset_is_reproducible() -> None:
    # Pinned: same seed, same secret in every process (changes only with the word lists).
    assert _secret_for(7) == _secret_for(7) == "livid"
    assert len({_secret_for(seed) for seed in range(20)}) > 10


def test_word_option_sets_the_secret() -> None:
    env = WordleEnvironment()
    observation = env.reset(word="CRANE", episode_id="ep-1")
    assert (observation.reward, observation.done, observation.info) == (0.0, False, {})
    assert env.step(WordleAction(message="[crane]")).reward == 1.0
    assert env.state.episode_id == "ep-1"
    assert env.state.raw_state["secret_word"] == "crane"


LONG = "x" * 100_000


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seed": "7"}, r"seed: Input should be a valid integer"),
        ({"seed": True}, r"seed: Input should be a valid integer"),
        ({"seed": 7.0}, r"seed: Input should be a valid integer"),
        ({"seed": float("inf")}, r"seed: Input should be a valid integer"),
        ({"seed": -1}, r"seed: Input should be greater than or equal to 0"),
        ({"seed": 2**64}, r"seed: Input should be less than or equal to"),
        ({"word": "xqzvw"}, r"word: 'xqzvw' is not an allowed guess"),
        ({"word": "cr\u00e4ne"}, r"word: 'cr\u00e4ne' is not an allowed guess"),
        ({"word": 12345}, r"word: Input should be a valid string"),
        ({"word": LONG}, r"word: String should have at most 5 characters"),
        ({"word": ["crane"]}, r"word: Input should be a valid string"),
        ({"episode_id": 3}, r"episode_id: Input should be a valid string"),
        ({"episode_id": LONG}, r"episode_id: String should have at most 255 characters"),
        ({"colour": "green"}, r"colour: Extra inputs are not permitted.*seed, episode_id, word"),
        ({LONG: 1}, r"x{40}: Extra inputs are not permitted"),
    ],
)
def test_bad_reset_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidResetError, match=message) as refused:
        WordleEnvironment().reset(**options)
    assert len(str(refused.value)) < 300  # names the option, never echoes a long value
    assert isinstance(refused.value, ValueError)  # OpenEnv answers it as an EXECUTION_ERROR


def test_longest_episode_id_is_kept() -> None:
    env = WordleEnvironment()
    env.reset(word="crane", episode_id="e" * MAX_EPISODE_ID_CHARS)
    assert env.state.episode_id == "e" * MAX_EPISODE_ID_CHARS


def test_bad_reset_keeps_the_running_game() -> None:
    env = WordleEnvironment()
    env.reset(word="crane")
    for bad in ({"word": "xqzvw"}, {"seed": float("inf")}, {"episode_id": LONG}):
        with pytest.raises(InvalidResetError):
            env.reset(**bad)
    assert env.state.episode_id != LONG
    assert env.step(WordleAction(message="[crane]")).reward == 1.0


def test_step_before_reset_answers_done_with_an_error() -> None:
    observation = WordleEnvironment().step(WordleAction(message="[crane]"))
    assert (observation.done, observation.reward) == (True, 0.0)
    assert observation.info == {"error": "No game in progress. Send reset before step."}
    assert "Send reset" in observation.messages[0].content


def test_step_after_end_keeps_transcript_and_final_reward() -> None:
    env = WordleEnvironment()
    env.reset(word="crane")
    final = env.step(WordleAction(message="[crane]"))
    after = env.step(WordleAction(message="[slate]"))
    assert (after.done, after.reward) == (True, 1.0)
    assert after.messages[0].content == final.messages[0].content
    assert after.info == {"error": "The game is over. Send reset to start a new game."}
    assert env.state.step_count == 1


def test_state_tracks_turns_and_hides_the_secret_until_the_end() -> None:
    env = WordleEnvironment()
    env.reset(word="crane")
    env.step(WordleAction(message="[ab]"))  # warning: a step, not a turn
    env.step(WordleAction(message="[slate]"))
    state = env.state
    assert (state.step_count, state.turn, state.last_reward) == (2, 1, 0.0)
    assert state.raw_state == {"guesses": [["slate", "XXGXG"]], "done": False, "reason": None}
    assert state.last_info["reward_signals"]["wordle.greens"] == 0.4


def test_reward_signals_in_info_and_metadata() -> None:
    env = WordleEnvironment()
    env.reset(word="crane")
    observation = env.step(WordleAction(message="[react]"))
    signals = observation.info["reward_signals"]
    assert signals == observation.metadata["reward_signals"]
    assert set(signals) == {
        "wordle.greens",
        "wordle.yellows",
        "wordle.repetitions",
        "wordle.correct",
    }


def test_step_rejects_other_action_types() -> None:
    env = WordleEnvironment()
    env.reset(word="crane")
    with pytest.raises(TypeError, match="expected WordleAction"):
        env.step({"message": "[crane]"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message",
    ["[cr\u00e4ne]", "\u2603", "x" * (MAX_MESSAGE_CHARS + 1)],
    ids=["umlaut", "snowman", "long"],
)
def test_action_rejects_non_ascii_and_oversized(message: str) -> None:
    with pytest.raises(ValidationError):
        WordleAction(message=message)
