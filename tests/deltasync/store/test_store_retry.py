"""`RetryPolicy`: bucket errors are retried with doubling backoff; missing files are not; every
store operation goes through its store's policy."""

from __future__ import annotations

import pytest

from deltasync.errors import StoreError
from deltasync.store import LocalStore, MissingFile, RetryPolicy, retry


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
    assert RetryPolicy().call(fn, what="upload") == "ok"
    assert fn.calls == 1
    assert sleeps == []


def test_fails_twice_then_succeeds(sleeps: list[float]) -> None:
    fn = Flaky(2)
    assert RetryPolicy(attempts=4, backoff_s=0.001).call(fn, what="upload") == "ok"
    assert fn.calls == 3
    assert sleeps == [0.001, 0.002]


def test_gives_up_after_attempts(sleeps: list[float]) -> None:
    fn = Flaky(10)
    with pytest.raises(StoreError, match="gave up after 3 attempts") as info:
        RetryPolicy(attempts=3, backoff_s=0.001).call(fn, what="upload a.bin")
    assert fn.calls == 3
    assert sleeps == [0.001, 0.002]
    assert "upload a.bin" in str(info.value)
    assert info.value.path == "a.bin"
    assert info.value.__cause__ is fn.error


def test_backoff_doubles(sleeps: list[float]) -> None:
    with pytest.raises(StoreError):
        RetryPolicy(attempts=5, backoff_s=0.25).call(Flaky(10), what="x")
    assert sleeps == [0.25, 0.5, 1.0, 2.0]


def test_single_attempt_does_not_sleep(sleeps: list[float]) -> None:
    fn = Flaky(1)
    with pytest.raises(StoreError, match=r"injected|failed") as info:
        RetryPolicy(attempts=1).call(fn, what="x")
    assert info.value is fn.error  # one attempt: the error itself, nothing to give up on
    assert fn.calls == 1
    assert sleeps == []


def test_missing_file_is_not_retried(sleeps: list[float]) -> None:
    fn = Flaky(10, MissingFile("get: no such file", path="m.json"))
    with pytest.raises(MissingFile) as info:
        RetryPolicy(attempts=4).call(fn, what="read manifest")
    assert info.value is fn.error
    assert fn.calls == 1
    assert sleeps == []


def test_other_errors_are_not_retried(sleeps: list[float]) -> None:
    fn = Flaky(10, ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        RetryPolicy(attempts=4).call(fn, what="x")
    assert fn.calls == 1
    assert sleeps == []


def test_real_sleep_is_tiny() -> None:
    fn = Flaky(2)
    assert RetryPolicy(attempts=3, backoff_s=0.001).call(fn, what="x") == "ok"
    assert fn.calls == 3


class FailingWrites(LocalStore):
    """Each write attempt fails until `failures` are used up."""

    def __init__(self, folder, failures: int, retry_policy: RetryPolicy):
        super().__init__(folder, retry=retry_policy)
        self.failures = failures
        self.attempts = 0

    def _write(self, full, data):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise OSError("injected")
        super()._write(full, data)


def test_store_retries_its_own_operations(tmp_path, sleeps: list[float]) -> None:
    store = FailingWrites(tmp_path, 2, RetryPolicy(attempts=3, backoff_s=0.01))
    store.put("a/b.bin", b"xyz")
    assert store.attempts == 3 and sleeps == [0.01, 0.02]
    assert store.get("a/b.bin") == b"xyz"


def test_store_gives_up_with_its_policy(tmp_path, sleeps: list[float]) -> None:
    store = FailingWrites(tmp_path, 10, RetryPolicy(attempts=2, backoff_s=0.01))
    with pytest.raises(StoreError, match="gave up after 2 attempts") as info:
        store.publish("manifest.json", b"{}")
    assert isinstance(info.value.__cause__.__cause__, OSError)
    assert not store.exists("manifest.json")


def test_missing_object_is_not_retried_by_the_store(tmp_path, sleeps: list[float]) -> None:
    store = LocalStore(tmp_path, retry=RetryPolicy(attempts=4, backoff_s=1.0))
    with pytest.raises(MissingFile):
        store.get("nothing/here.bin")
    assert sleeps == []


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"attempts": 1.5}, {"backoff_s": -1}])
def test_policy_validates(bad) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)
