"""Wordle rules and transcript exactly as TextArena's ``Wordle-v0`` plays them, with no server code.

TextArena behaviour reproduced here (OpenEnv's TextArena server with the default wrappers):
a message without brackets is wrapped in them; the message is echoed into the transcript; the
first ``[word]`` in it is the guess; an invalid move (no brackets, wrong length, repeated word,
not a word) is a warning that costs no guess, and a second invalid move in a row ends the game;
a win ends the game with reward 1.0 and adds no feedback line; six scored guesses without a win
end it with the completion of the last guess ((greens + 0.5 * yellows) / 5), which is also the
reward of a game ended by invalid moves.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["NUM_GUESSES", "PROMPT", "WORD_LENGTH", "Turn", "WordleGame", "score_guess"]

WORD_LENGTH = 5
NUM_GUESSES = 6
PROMPT = (
    "You are Playing Wordle.\n"
    f"A secret {WORD_LENGTH}-letter word has been chosen. "
    f"You have {NUM_GUESSES} attempts to guess it.\n"
    "For each guess, wrap your word in square brackets (e.g., '[apple]').\n"
    "Feedback for each letter will be given as follows:\n"
    "  - G (green): correct letter in the correct position\n"
    "  - Y (yellow): letter exists in the word but in the wrong position\n"
    "  - X (wrong): letter is not in the word\n"
    "Enter your guess to begin.\n"
)
_GUESS = re.compile(r"\[(\w+)\]")
_ROLE_TAGS = ("[Player]", "[GAME]")  # TextArena strips its role tags from the echoed action
_WIN = "G" * WORD_LENGTH


def score_guess(guess: str, secret: str) -> str:
    """Return one of G/Y/X per letter; greens are matched first, then yellows left to right.

    A letter is yellow only while the secret still has an unmatched copy of it, so duplicate
    letters in the guess get at most as many G+Y marks as the secret has copies.
    """
    if len(guess) != len(secret):
        raise ValueError(f"guess {guess!r} and secret {secret!r} differ in length")
    feedback = ["X"] * len(guess)
    unmatched: list[str | None] = list(secret)
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            feedback[i] = "G"
            unmatched[i] = None
    for i, g in enumerate(guess):
        if feedback[i] != "G" and g in unmatched:
            feedback[i] = "Y"
            unmatched[unmatched.index(g)] = None
    return "".join(feedback)


def _completion(feedback: str | None) -> float:
    """TextArena's partial credit for a guess; kept in its exact arithmetic order."""
    if feedback is None:
        return 0.0
    return (feedback.count("G") + feedback.count("Y") * 0.5) / WORD_LENGTH


@dataclass(frozen=True)
class Turn:
    """What one message did: the parsed guess, its feedback if scored, and the outcome."""

    guess: str | None
    feedback: str | None
    invalid_reason: str | None
    reward: float
    done: bool
    signals: dict[str, float]


class WordleGame:
    """One game against a fixed secret; ``transcript`` is TextArena's cumulative player view."""

    def __init__(self, secret: str, allowed: Collection[str]) -> None:
        """Start a game; ``allowed`` is the set of accepted guesses (shared, never copied)."""
        if secret not in allowed:
            raise ValueError(f"secret {secret!r} is not an allowed word")
        self.secret = secret
        self._allowed = allowed
        self.transcript = f"\n[GAME] {PROMPT}"
        self.history: list[tuple[str, str]] = []
        self.done = False
        self.reward = 0.0
        self.reason: str | None = None
        self._warned = False
        self._submitted: Counter[str] = Counter()

    def play(self, message: str) -> Turn:
        """Apply one player message; raises RuntimeError once the game is over."""
        if self.done:
            raise RuntimeError("the game is over; start a new one")
        action = message if "[" in message or "]" in message else f"[{message}]"
        echo = action
        for tag in _ROLE_TAGS:
            echo = echo.replace(tag, "")
        self._say(echo)
        match = _GUESS.search(action)
        guess = match.group(1).lower() if match else None
        repeats = self._count_submission(guess if guess is not None else message.strip().lower())
        reason = self._invalid_reason(guess)
        if reason is not None:
            self._invalid(reason)
            return self._turn(guess, None, reason, repeats)
        assert guess is not None  # a valid move always has a guess
        self._warned = False
        feedback = score_guess(guess, self.secret)
        self.history.append((guess, feedback))
        if feedback == _WIN:
            self._end(1.0, "Congratulations! You guessed the word correctly!")
            return self._turn(guess, feedback, None, repeats)
        left = NUM_GUESSES - len(self.history)
        self._say(
            f"You submitted [{guess}].\nFeedback:\n{' '.join(guess.upper())}\n"
            f"{' '.join(feedback)}\nYou have {left} guesses left."
        )
        if left == 0:
            score = _completion(feedback)
            self._end(
                score,
                "The turn limit has been reached. You didn't guess the word, but your best guess "
                f"matched {round(score * 100)}% of the letters in the correct positions.\n"
                f"The secret word was: **{self.secret}**.",
            )
        return self._turn(guess, feedback, None, repeats)

    def _say(self, text: str) -> None:
        self.transcript += f"\n[GAME] {text}"

    def _count_submission(self, key: str) -> int:
        previous = self._submitted[key]
        self._submitted[key] += 1
        return previous

    def _invalid_reason(self, guess: str | None) -> str | None:
        if guess is None:
            return (
                "You tried submitting a word in the wrong format. "
                "Please make sure to use squared brackets."
            )
        if len(guess) != WORD_LENGTH:
            return f"Your word must be exactly {WORD_LENGTH} letters."
        if any(guess == word for word, _ in self.history):
            return f"You have already guessed '{guess}' before. Please try a different word."
        if guess not in self._allowed:
            return f"'{guess}' is not an English word."
        return None

    def _invalid(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            self._say(
                f"You attempted an invalid move. Reason: {reason} Please resubmit a valid move "
                "and remember to follow the game rules to avoid penalties."
            )
            return
        last = self.history[-1][1] if self.history else None
        self._end(_completion(last), f"Invalid Move: {reason}")

    def _end(self, reward: float, reason: str) -> None:
        self.done = True
        self.reward = reward
        self.reason = reason

    def _turn(
        self, guess: str | None, feedback: str | None, reason: str | None, repeats: int
    ) -> Turn:
        reward = self.reward if self.done else 0.0
        signals = {
            "wordle.greens": feedback.count("G") / WORD_LENGTH if feedback else 0.0,
            "wordle.yellows": feedback.count("Y") / WORD_LENGTH if feedback else 0.0,
            "wordle.repetitions": 1.0 - repeats,
            "wordle.correct": reward,
        }
        return Turn(guess, feedback, reason, reward, self.done, signals)
