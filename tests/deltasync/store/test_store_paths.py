"""`validate_path`: the one gate every store method passes before it touches the bucket."""

from __future__ import annotations

import pytest

from deltasync.errors import DeltaSyncError, StoreError
from deltasync.store import MissingFile, validate_path


def _rejected(path: object) -> StoreError:
    with pytest.raises(StoreError, match="invalid bucket path") as info:
        validate_path(path)  # type: ignore[arg-type]
    return info.value


def test_accepts_plain_paths() -> None:
    for path in ["a", "manifest.json", "runs/r1/deltas/000001.bin", "_x/a-b.c_d", "A9/b..c"]:
        assert validate_path(path) == path


def test_rejects_dotdot() -> None:
    _rejected("..")


def test_rejects_parent_escape() -> None:
    _rejected("../x")


def test_rejects_inner_dotdot() -> None:
    _rejected("a/../b")


def test_rejects_dot() -> None:
    _rejected("./a")


def test_rejects_absolute() -> None:
    _rejected("/abs")


def test_rejects_double_slash() -> None:
    _rejected("a//b")


def test_rejects_trailing_slash() -> None:
    _rejected("a/")


def test_rejects_empty() -> None:
    _rejected("")


def test_rejects_hidden() -> None:
    _rejected(".hidden")
    _rejected("a/.hidden")


def test_rejects_backslash() -> None:
    _rejected("a\\b")
    _rejected("..\\x")


def test_rejects_scheme() -> None:
    _rejected("hf://x")
    _rejected("s3://bucket/x")


def test_rejects_control_characters() -> None:
    _rejected("a\x00b")
    _rejected("a\n")


def test_rejects_non_ascii() -> None:
    _rejected("caf\u00e9")


def test_rejects_very_long_path() -> None:
    error = _rejected("a/" * 512 + "b")
    assert "1-1024" in str(error)


def test_rejects_long_component() -> None:
    _rejected("a" * 201)


def test_accepts_longest_path() -> None:
    path = "/".join(["a" * 200] * 5) + "/" + "b" * 19
    assert len(path) == 1024
    assert validate_path(path) == path


def test_rejects_non_str() -> None:
    for path in [None, 1, b"a", ["a"]]:
        _rejected(path)


def test_error_message_says_what_is_allowed() -> None:
    message = str(_rejected("../x"))
    assert "'../x'" in message
    assert "no '..'" in message


def test_store_error_is_the_root_error() -> None:
    assert issubclass(StoreError, DeltaSyncError)
    assert issubclass(MissingFile, StoreError)
    assert issubclass(MissingFile, FileNotFoundError)
