"""The shipped word lists: shape, and read once per process rather than per session."""

from __future__ import annotations

import re
from importlib import resources

from wordle_env.server import WordleEnvironment
from wordle_env.words import load_word_lists


def test_lists_are_five_letter_ascii_and_answers_are_guesses() -> None:
    words = load_word_lists()
    assert len(words.answers) > 2000 and len(words.guesses) > 10000
    assert list(words.answers) == sorted(set(words.answers))
    assert all(re.fullmatch(r"[a-z]{5}", w) for w in words.guesses)
    assert set(words.answers) <= words.guesses


def test_loaded_once_and_shared_by_sessions() -> None:
    first, second = WordleEnvironment(), WordleEnvironment()
    assert first._words is second._words is load_word_lists()


def test_source_and_licence_are_documented() -> None:
    readme = resources.files("wordle_env").joinpath("data", "README.md").read_text()
    for needle in ("textarena", "english-words", "MIT", "public domain", "build_word_lists"):
        assert needle in readme
