"""A folder bucket with scripted faults: failed, slow, truncating or hanging operations.

`FaultStore` is the real `LocalStore` (temp file, fsync, rename) with a hook inside each attempt
of `put`, `publish` and `get`: an injected error is raised inside the store's own retried call
(`Store._call`), exactly where a real I/O error (ENOSPC, a reset connection) would surface, so the
store's retry policy sees it and the library gets a `StoreError` with the original exception as
its cause. Each attempt is one logged call. Every call is logged with a
`time.perf_counter()` stamp, so tests compare the order of events, never absolute durations.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fsspec.implementations.memory import MemoryFileSystem

from deltasync.store import LocalStore, RetryPolicy, Store


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def connection_reset() -> OSError:
    return ConnectionResetError(errno.ECONNRESET, "connection reset by peer (injected)")


@dataclass
class Fault:
    """What happens to matching calls.

    Attributes:
        op: "put", "publish" (the manifest commit: `publish` or `swap`), "get" or "delete".
        where: which paths match.
        times: how many matching calls fail (None: all of them).
        error: raised after the gate (None: the call then proceeds normally).
        truncate: for writes, first leave this fraction of the bytes at the path, as a
            non-atomic object store or a crash mid-copy would.
        gate: the call then blocks until this event is set (a slow or hanging upload).
    """

    op: str
    where: Callable[[str], bool] = lambda path: True
    times: int | None = 1
    error: Callable[[], BaseException] | None = enospc
    truncate: float | None = None
    gate: threading.Event | None = None
    hits: int = 0  # matching calls so far
    blocked: int = 0  # calls that reached the gate (after any truncated write landed)


@dataclass
class Call:
    op: str
    path: str
    started: float
    finished: float | None = None
    ok: bool | None = None


class FaultMixin:
    """The fault hook over any `Store`: each attempt of put, publish and get passes `_run`."""

    def _init_faults(self) -> None:
        self.faults: list[Fault] = []
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def ops(self, op: str, *, ok: bool | None = None) -> list[str]:
        """Paths of the logged calls of one kind, in order (optionally only (un)successful)."""
        return [c.path for c in self.calls if c.op == op and (ok is None or c.ok is ok)]

    def _pick(self, op: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.op == op and fault.where(path) and (fault.times is None or fault.times):
                    fault.hits += 1
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def _call(self, what: str, path: str, fn: Callable, *args: object, **kwargs: object) -> object:
        if what not in ("put", "publish", "swap", "get", "delete"):
            return super()._call(what, path, fn, *args, **kwargs)  # type: ignore[misc]
        op = "publish" if what == "swap" else what  # both commit the manifest

        def attempt(*a: object, **k: object) -> object:
            data = a[1] if what not in ("get", "delete") else b""
            return self._run(op, path, lambda: fn(*a, **k), data)

        return super()._call(what, path, attempt, *args, **kwargs)  # type: ignore[misc]

    def _run(self, op: str, path: str, action: Callable[[], object], data: object) -> object:
        call = Call(op, path, time.perf_counter())
        with self._lock:
            self.calls.append(call)
        try:
            fault = self._pick(op, path)
            if fault is not None:
                if fault.truncate is not None:
                    partial = bytes(data)[: int(len(data) * fault.truncate)]  # type: ignore[arg-type]
                    self._write(self._full(path), partial)  # type: ignore[attr-defined]
                if fault.gate is not None:
                    with self._lock:
                        fault.blocked += 1
                    fault.gate.wait(timeout=60)
                if fault.error is not None:
                    raise fault.error()
            result = action()
        except BaseException:
            call.ok = False
            raise
        finally:
            call.finished = time.perf_counter()
        call.ok = True
        return result


FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.001)


class FaultStore(FaultMixin, LocalStore):
    """A folder bucket (temp file, fsync, rename) with the fault hook."""

    def __init__(self, folder: str | os.PathLike[str], *, retry: RetryPolicy = FAST_RETRY):
        super().__init__(folder, retry=retry)
        self._init_faults()


class MemoryFaultStore(FaultMixin, Store):
    """An fsspec `memory://` bucket with the fault hook: no fsync, for many small writes."""

    def __init__(self, *, retry: RetryPolicy = FAST_RETRY) -> None:
        root = f"/reliability-{uuid.uuid4().hex}"
        super().__init__(MemoryFileSystem(), root, f"memory://{root}", retry=retry)
        self._init_faults()

    def remove(self) -> None:
        self.fs.rm(self.root, recursive=True)
