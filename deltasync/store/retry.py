"""The retry policy a store applies to every bucket operation (exponential backoff)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from deltasync.errors import StoreError

__all__ = ["Conflict", "MissingFile", "RefusedObject", "RetryPolicy"]

T = TypeVar("T")
log = logging.getLogger("deltasync.store")


class MissingFile(StoreError, FileNotFoundError):
    """The path does not exist in the bucket (never retried: waiting does not create it)."""


class RefusedObject(StoreError):
    """An object the store will not read: not a regular file (a symlink, FIFO or device in a
    folder bucket) or larger than the reader expects. Never retried."""


class Conflict(StoreError):
    """A conditional write found another object in place: another writer got there first.
    Never retried (the caller decides whether it lost)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failed bucket operation is tried, and how long to wait in between.

    Attributes:
        attempts: calls in all (1: no retry).
        backoff_s: the first delay; each later one doubles it.
    """

    attempts: int = 4
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {self.attempts!r}")
        if not self.backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s!r}")

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Call `fn`, retrying `StoreError`s (not missing, refused or conflicting objects) with
        delays backoff, 2x, 4x, ...

        Raises:
            StoreError: the last error, once `attempts` calls failed, saying how many were made.
        """
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except (MissingFile, RefusedObject, Conflict):
                raise
            except StoreError as exc:
                if attempt == self.attempts:
                    if self.attempts == 1:
                        raise
                    raise StoreError(
                        f"{what}: gave up after {self.attempts} attempts: {exc}", path=exc.path
                    ) from exc
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning(
                    "%s failed (attempt %d/%d), retrying in %.2fs: %s",
                    what,
                    attempt,
                    self.attempts,
                    delay,
                    exc,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")
