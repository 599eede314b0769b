"""`with_retries`: bucket errors are retried with doubling backoff; missing files are not."""

from __future__ import annotations

import pytest

from deltasync import retry
from deltasync.errors import StoreError
from deltasync.retry import with_retries
from deltasync.store import MissingFile


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", recorded.append)
    return recorded


class Flaky:
    """Fails with `error` the first `failures` calls, then returns 'ok'."""

    def __init__(self, failures: int, error: Exception | None = None):
        self.failures = failures
        self.error = error or StoreError("put failed: ConnectionError", path="a.bin")
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def test_succeeds_first_time(sleeps: list[float]) -> None:
    fn = Flaky(0)
    assert with_retries(fn, what="upload") == "ok"
    assert fn.calls == 1
    assert sleeps == []


def test_fails_twice_then_succeeds(sleeps: list[float]) -> None:
    fn = Flaky(2)
    assert with_retries(fn, what="upload", attempts=4, backoff_s=0.001) == "ok"
    assert fn.calls == 3
    assert sleeps == [0.001, 0.002]


def test_gives_up_after_attempts(sleeps: list[float]) -> None:
    fn = Flaky(10)
    with pytest.raises(StoreError, match="gave up after 3 attempts") as info:
        with_retries(fn, what="upload a.bin", attempts=3, backoff_s=0.001)
    assert fn.calls == 3
    assert sleeps == [0.001, 0.002]
    assert "upload a.bin" in str(info.value)
    assert info.value.path == "a.bin"
    assert info.value.__cause__ is fn.error


def test_backoff_doubles(sleeps: list[float]) -> None:
    with pytest.raises(StoreError):
        with_retries(Flaky(10), what="x", attempts=5, backoff_s=0.25)
    assert sleeps == [0.25, 0.5, 1.0, 2.0]


def test_single_attempt_does_not_sleep(sleeps: list[float]) -> None:
    fn = Flaky(1)
    with pytest.raises(StoreError, match="gave up after 1 attempts"):
        with_retries(fn, what="x", attempts=1)
    assert fn.calls == 1
    assert sleeps == []


def test_missing_file_is_not_retried(sleeps: list[float]) -> None:
    fn = Flaky(10, MissingFile("get: no such file", path="m.json"))
    with pytest.raises(MissingFile) as info:
        with_retries(fn, what="read manifest", attempts=4)
    assert info.value is fn.error
    assert fn.calls == 1
    assert sleeps == []


def test_other_errors_are_not_retried(sleeps: list[float]) -> None:
    fn = Flaky(10, ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        with_retries(fn, what="x", attempts=4)
    assert fn.calls == 1
    assert sleeps == []


def test_real_sleep_is_tiny() -> None:
    fn = Flaky(2)
    assert with_retries(fn, what="x", attempts=3, backoff_s=0.001) == "ok"
    assert fn.calls == 3
