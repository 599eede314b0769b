"""Retries with exponential backoff for bucket operations."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import StoreError
from .store import MissingFile

__all__ = ["with_retries"]

T = TypeVar("T")
log = logging.getLogger(__name__)


def with_retries(fn: Callable[[], T], *, what: str, attempts: int = 4, backoff_s: float = 0.5) -> T:
    """Call `fn`, retrying `StoreError`s (not missing files) with delays backoff, 2x, 4x, ...

    Raises:
        StoreError: the last error, once `attempts` calls failed, saying how many were made.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except MissingFile:
            raise
        except StoreError as exc:
            if attempt == attempts:
                raise StoreError(
                    f"{what}: gave up after {attempts} attempts: {exc}", path=exc.path
                ) from exc
            delay = backoff_s * 2 ** (attempt - 1)
            log.warning(
                "%s failed (attempt %d/%d), retrying in %.2fs: %s",
                what,
                attempt,
                attempts,
                delay,
                exc,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")
