"""A bucket with real latency, for benchmarks and tests: any `Store` behind a per-call round trip
and a per-stream bandwidth cap, counting every call.

A Hub bucket costs hundreds of ms per call and one stream carries about 85-90 MB/s, so the number
of calls per version, not the bytes, sets a small delta's sync time. `LatencyStore` makes each
call of the wrapped store take `latency_s + bytes / bandwidth` longer (bytes sent or received;
calls in parallel threads wait in parallel, as separate streams do) and records it as a `Call`,
from which calls per side and per version are counted. A `swap` counts as one call here; a store
without conditional writes makes it three round trips (read, write, read back).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from deltasync.store.base import Store

__all__ = ["Call", "LatencyStore"]

T = TypeVar("T")
_VERSIONED = re.compile(r"runs/[^/]+/(anchors|deltas|metrics)/(\d{8})")
_TARGETS = {"anchors": "anchor", "deltas": "delta", "metrics": "metrics"}


@dataclass(frozen=True)
class Call:
    """One store call: its kind (`get`, `get_range`, `put`, ...), path, bytes moved, when it
    ended and when it started (`time.monotonic`; calls made at once overlap)."""

    kind: str
    path: str
    bytes: int
    at: float
    started: float = float("nan")

    @property
    def target(self) -> str:
        """`manifest`, `anchor`, `delta`, `metrics` or `other`."""
        if self.path == "manifest.json":
            return "manifest"
        found = _VERSIONED.match(self.path)
        return _TARGETS[found.group(1)] if found else "other"

    @property
    def version(self) -> int | None:
        """The version a run's file belongs to (None: the manifest, a listing, ...)."""
        found = _VERSIONED.match(self.path)
        return int(found.group(2)) if found else None


class LatencyStore(Store):
    """`inner` with `latency_s` added to every call and its transfer capped at `bandwidth`
    bytes/s per call (None: no cap). `calls` lists every call in the order they ended."""

    def __init__(self, inner: Store, *, latency_s: float = 0.15, bandwidth: float | None = 80e6):
        super().__init__(inner.fs, inner.root, inner.url, retry=inner.retry)
        self.inner = inner
        self.conditional_writes = inner.conditional_writes
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def _timed(self, kind: str, path: str, sent: int, fn: Callable[[], T]) -> T:
        """Run one call of `inner`, then wait out its round trip and transfer, and record it."""
        received, started = 0, time.monotonic()
        try:
            result = fn()
            received = len(result) if isinstance(result, bytes) else 0
            return result
        finally:
            moved = sent + received
            transfer = moved / self.bandwidth if self.bandwidth else 0.0
            time.sleep(self.latency_s + transfer)
            with self._lock:
                self.calls.append(Call(kind, path, moved, time.monotonic(), started))

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        return self._timed("get", path, 0, lambda: self.inner.get(path, limit=limit))

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self._timed("get_range", path, 0, lambda: self.inner.get_range(path, start, end))

    def size(self, path: str) -> int:
        return self._timed("size", path, 0, lambda: self.inner.size(path))

    def exists(self, path: str) -> bool:
        return self._timed("exists", path, 0, lambda: self.inner.exists(path))

    def list(self, prefix: str = "") -> list[str]:
        return self._timed("list", prefix, 0, lambda: self.inner.list(prefix))

    def put(self, path: str, data: bytes) -> None:
        self._timed("put", path, len(data), lambda: self.inner.put(path, data))

    def publish(self, path: str, data: bytes) -> None:
        self._timed("publish", path, len(data), lambda: self.inner.publish(path, data))

    def swap(self, path: str, data: bytes, *, expected: bytes | None) -> None:
        self._timed("swap", path, len(data), lambda: self.inner.swap(path, data, expected=expected))

    def delete(self, path: str) -> None:
        self._timed("delete", path, 0, lambda: self.inner.delete(path))
