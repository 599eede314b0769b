"""Feedback rules and TextArena transcripts of ``wordle_env.game``, without a server."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wordle_env.game import PROMPT, WordleGame, score_guess
from wordle_env.words import load_word_lists

START = f"\n[GAME] {PROMPT}"
WARNING = (
    "\n[GAME] You attempted an invalid move. Reason: {} Please resubmit a valid move and "
    "remember to follow the game rules to avoid penalties."
)


@pytest.mark.parametrize(
    ("guess", "secret", "feedback"),
    [
        ("crane", "crane", "GGGGG"),
        ("slate", "crane", "XXGXG"),
        ("react", "crane", "YYGYX"),
        # One E in the secret: the green E takes it, the guess's other Es are X.
        ("eerie", "crane", "XXYXG"),
        ("speed", "abbey", "XXXGX"),
        # Three Es in the guess, two in the secret: the two leftmost are yellow.
        ("eerie", "speed", "YYXXX"),
        # Greens are matched before yellows, even when the yellow comes first.
        ("abbey", "robot", "XXGXX"),
        ("lolly", "hello", "XYGGX"),
        ("level", "hello", "YGXXY"),
        # Duplicates on both sides.
        ("geese", "eerie", "XGYXG"),
        ("eager", "geese", "YXYYX"),
    ],
)
def test_feedback_table(guess: str, secret: str, feedback: str) -> None:
    assert score_guess(guess, secret) == feedback


def test_feedback_length_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        score_guess("cranes", "crane")


_WORDS = st.text(alphabet="abcde", min_size=5, max_size=5)  # few letters: many duplicates


@given(_WORDS, _WORDS)
def test_feedback_properties(guess: str, secret: str) -> None:
    feedback = score_guess(guess, secret)
    assert [f == "G" for f in feedback] == [g == s for g, s in zip(guess, secret, strict=True)]
    guess_counts, secret_counts = Counter(guess), Counter(secret)
    for letter in guess_counts:
        marked = [i for i, g in enumerate(guess) if g == letter and feedback[i] != "X"]
        assert len(marked) == min(guess_counts[letter], secret_counts[letter])
        # Yellows go to the leftmost non-green copies.
        non_green = [i for i, g in enumerate(guess) if g == letter and feedback[i] != "G"]
        yellows = [i for i in non_green if feedback[i] == "Y"]
        assert yellows == non_green[: len(yellows)]


def _game(secret: str = "crane") -> WordleGame:
    return WordleGame(secret, load_word_lists().guesses)


def test_win_transcript_and_reward() -> None:
    game = _game()
    first = game.play("[slate]")
    assert (first.feedback, first.reward, first.done) == ("XXGXG", 0.0, False)
    last = game.play("crane")  # a bare word is wrapped in brackets
    assert (last.feedback, last.reward, last.done) == ("GGGGG", 1.0, True)
    assert game.transcript == START + (
        "\n[GAME] [slate]\n[GAME] You submitted [slate].\nFeedback:\nS L A T E\nX X G X G\n"
        "You have 5 guesses left.\n[GAME] [crane]"
    )
    assert game.reason == "Congratulations! You guessed the word correctly!"


def test_loss_after_six_scores_last_guess() -> None:
    game = _game()
    turns = [game.play(f"[{w}]") for w in ("slate", "pious", "dwelt", "handy", "eerie", "react")]
    assert [t.done for t in turns] == [False] * 5 + [True]
    assert [t.reward for t in turns] == [0.0] * 5 + [0.5]  # YYGYX: (1 + 3 * 0.5) / 5
    assert game.transcript.endswith(
        "\n[GAME] [react]\n[GAME] You submitted [react].\nFeedback:\nR E A C T\nY Y G Y X\n"
        "You have 0 guesses left."
    )
    assert game.reason is not None and "The secret word was: **crane**." in game.reason


@pytest.mark.parametrize(
    ("message", "echo", "reason"),
    [
        (
            "crane]",
            "crane]",
            "You tried submitting a word in the wrong format. "
            "Please make sure to use squared brackets.",
        ),
        (
            "two words",
            "[two words]",
            "You tried submitting a word in the wrong format. "
            "Please make sure to use squared brackets.",
        ),
        ("[crab]", "[crab]", "Your word must be exactly 5 letters."),
        ("[cranes]", "[cranes]", "Your word must be exactly 5 letters."),
        ("[xqzvw]", "[xqzvw]", "'xqzvw' is not an English word."),
        ("[12345]", "[12345]", "'12345' is not an English word."),
        # TextArena strips role tags from the echo but parses the raw message: "[GAME]".
        ("[GAME] [Player] go", "  go", "Your word must be exactly 5 letters."),
    ],
)
def test_invalid_move_is_a_warning(message: str, echo: str, reason: str) -> None:
    game = _game()
    turn = game.play(message)
    assert (turn.reward, turn.done, turn.invalid_reason) == (0.0, False, reason)
    assert game.transcript == START + f"\n[GAME] {echo}" + WARNING.format(reason)
    assert game.history == []  # no guess used


def test_repeated_guess_is_invalid() -> None:
    game = _game()
    game.play("[slate]")
    turn = game.play("[SLATE]")
    assert (
        turn.invalid_reason
        == "You have already guessed 'slate' before. Please try a different word."
    )
    assert turn.signals["wordle.repetitions"] == 0.0


def test_second_invalid_in_a_row_ends_with_last_guess_completion() -> None:
    game = _game()
    game.play("[slate]")  # XXGXG
    game.play("hello there")
    before = game.transcript
    turn = game.play("[xqzvw]")
    assert (turn.done, turn.reward) == (True, 0.4)
    assert game.transcript == before + "\n[GAME] [xqzvw]"  # no further message, as in TextArena
    assert game.reason == "Invalid Move: 'xqzvw' is not an English word."


def test_second_invalid_without_guesses_scores_zero() -> None:
    game = _game()
    game.play("[ab]")
    assert game.play("[ab]").reward == 0.0 and game.done


def test_valid_guess_resets_the_warning() -> None:
    game = _game()
    game.play("[ab]")
    game.play("[slate]")
    turn = game.play("[ab]")
    assert not turn.done and game.transcript.endswith(
        WARNING.format("Your word must be exactly 5 letters.")
    )


def test_reward_signals() -> None:
    game = _game()
    assert game.play("[react]").signals == {
        "wordle.greens": 0.2,
        "wordle.yellows": 0.6,
        "wordle.repetitions": 1.0,
        "wordle.correct": 0.0,
    }
    assert game.play("[crane]").signals == {
        "wordle.greens": 1.0,
        "wordle.yellows": 0.0,
        "wordle.repetitions": 1.0,
        "wordle.correct": 1.0,
    }


def test_play_after_end_raises() -> None:
    game = _game()
    game.play("[crane]")
    with pytest.raises(RuntimeError, match="game is over"):
        game.play("[slate]")


def test_secret_must_be_allowed() -> None:
    with pytest.raises(ValueError, match="not an allowed word"):
        _game("xqzvw")
