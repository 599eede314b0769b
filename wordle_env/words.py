"""Shipped word lists, read once per process and shared by every session."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

__all__ = ["WordLists", "load_word_lists"]

_WORD = re.compile(r"[a-z]{5}")


@dataclass(frozen=True)
class WordLists:
    """Possible secrets (sorted, so a seed picks the same word everywhere) and allowed guesses."""

    answers: tuple[str, ...]
    guesses: frozenset[str]


def _read(name: str) -> list[str]:
    text = resources.files("wordle_env").joinpath("data", name).read_text(encoding="ascii")
    words = text.split()
    bad = [w for w in words if not _WORD.fullmatch(w)]
    if bad or not words:
        raise ValueError(
            f"wordle_env/data/{name}: expected lowercase five-letter words, found {bad[:5]} "
            f"({len(words)} words); rebuild with python -m wordle_env.build_word_lists"
        )
    return words


@functools.cache
def load_word_lists() -> WordLists:
    """Return the word lists; the first call reads the files, later calls get the same object."""
    answers = tuple(sorted(_read("answers.txt")))
    guesses = frozenset(_read("guesses.txt"))
    missing = [w for w in answers if w not in guesses]
    if missing:
        raise ValueError(f"answers missing from guesses.txt: {missing[:5]}")
    return WordLists(answers=answers, guesses=guesses)
