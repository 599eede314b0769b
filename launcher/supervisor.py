"""Local processes under one supervisor: log files, a quiet console, health checks, shutdown.

Each process's output goes to its own log file in `log_dir`. The console shows the launcher's
lines and the output of processes marked `console` (the trainer, which writes its own log file
and whose terminal is one line per version); `verbose` streams every process too, each line
prefixed with its name.

Each child runs in its own session (process group), so Ctrl-C reaches only the launcher, which
then stops every group: SIGTERM, a grace period, SIGKILL. Descendants that moved to a session of
their own (vLLM's server does) are tracked with psutil when it is installed and killed too, so
no process outlives the launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from .errors import ProcessFailed

__all__ = ["Child", "ProcessSpec", "Supervisor"]

_TAIL_LINES = 40
_POLL_S = 0.5
_PROBE_S = 2.0  # between two health probes of one process
_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProcessSpec:
    """One process. It is ready when `ready_line` appears in its output, or `ready_url`
    answers 200, or at once when neither is set. Once ready, a process with a `health_url`
    that answers no 200 for `unhealthy_after_s` has failed though it still runs (e.g. a vLLM
    API server whose engine process died: `/health` answers 503)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    ready_line: str | None = None
    ready_url: str | None = None
    stop_grace_s: float = 15.0
    console: bool = False  # its output is shown even when the supervisor is not verbose
    health_url: str | None = None
    unhealthy_after_s: float = 15.0


class Child:
    def __init__(self, spec: ProcessSpec, proc: subprocess.Popen, log: TextIO | None):
        self.spec = spec
        self.proc = proc
        self.log = log
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.ready = threading.Event()
        self.reader: threading.Thread | None = None
        self.awaited = False  # its exit was waited for: it is done, not failed
        self.next_probe = 0.0  # monotonic time of its next health probe
        self.unhealthy_since: float | None = None

    def last_lines(self, n: int = 15) -> str:
        return "\n".join(f"    {line}" for line in list(self.tail)[-n:])


class Supervisor:
    """Starts processes, merges their output with a `name |` prefix, stops them all on exit.

    Use as a context manager; leaving it (normally, by an exception, Ctrl-C or SIGTERM) stops
    every process it started.
    """

    def __init__(
        self,
        out: TextIO | None = None,
        log_dir: Path | None = None,
        cwd: Path | None = None,
        *,
        verbose: bool = True,
    ):
        self.out = out or sys.stdout
        self.verbose = verbose
        self.log_dir = log_dir
        self.cwd = cwd
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._width = 9
        self._seen: dict[int, float] = {}  # descendants (pid -> create time), for the sweep
        self._handlers: dict[int, object] = {}

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, _exit_on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)

    def say(self, message: str, *, detail: bool = False) -> None:
        """A line of the launcher's own in the shared stream (`detail`: only when verbose)."""
        if self.verbose or not detail:
            self._emit("launch", message)

    def start(self, spec: ProcessSpec) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        log = None
        if self.log_dir is not None and not spec.console:  # a console process writes its own
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = (self.log_dir / f"{spec.name}.log").open("w", encoding="utf-8")
        proc = subprocess.Popen(
            list(spec.argv),
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        child = Child(spec, proc, log)
        if spec.ready_line is None and spec.ready_url is None:
            child.ready.set()
        child.reader = threading.Thread(target=self._read, args=(child,), daemon=True)
        child.reader.start()
        self.children.append(child)
        self._width = max(self._width, len(spec.name))
        return child

    def wait_ready(self, children: Sequence[Child], timeout_s: float) -> None:
        """Block until every child is ready; raises `ProcessFailed` when one exits or is late."""
        deadline = time.monotonic() + timeout_s
        pending = [c for c in children if not c.ready.is_set()]
        while pending:
            self._track()
            for child in pending:
                self._check_alive(child, "during start-up")
                if child.spec.ready_url and _health_failure(child.spec.ready_url, 2) is None:
                    child.ready.set()
            pending = [c for c in pending if not c.ready.is_set()]
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.spec.name for c in pending)
                first = pending[0]
                raise ProcessFailed(
                    f"{names} not ready after {timeout_s:.0f}s; last lines of {first.spec.name}:"
                    f"\n{first.last_lines()}",
                    name=first.spec.name,
                )
            time.sleep(_POLL_S)

    def wait_exit(self, child: Child, timeout_s: float | None = None) -> int:
        """Block until `child` exits and return its status; raises `ProcessFailed` if any
        other child dies first, or if `timeout_s` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while child.proc.poll() is None:
            self._track()
            for other in self.children:
                if other is not child and not other.awaited:
                    self._check_alive(other, f"while {child.spec.name} was running")
                    self._check_health(other, f"while {child.spec.name} was running")
            if deadline is not None and time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{child.spec.name} still running after {timeout_s:.0f}s", name=child.spec.name
                )
            time.sleep(_POLL_S)
        child.awaited = True
        if child.reader is not None:
            child.reader.join(timeout=5)
        return child.proc.returncode

    def stop_all(self) -> None:
        """SIGTERM every process group (newest first), wait, SIGKILL what is left."""
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        try:
            self._track()
            alive = [c for c in reversed(self.children) if c.proc.poll() is None]
            if alive:
                grace = max(c.spec.stop_grace_s for c in alive)
                names = ", ".join(c.spec.name for c in alive)
                self.say(f"stopping {names} (up to {grace:.0f}s)", detail=True)
            # A reaped leader's pid may belong to someone else by now: signal live groups only;
            # what such a group leaves behind is in `_seen` and goes in the sweep.
            for child in alive:
                _signal_group(child.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + max((c.spec.stop_grace_s for c in alive), default=0)
            while any(c.proc.poll() is None for c in alive) and time.monotonic() < deadline:
                time.sleep(0.2)
            for child in alive:
                if child.proc.poll() is None:
                    _signal_group(child.proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.proc.wait(timeout=10)
            self._sweep()
            for child in self.children:
                if child.reader is not None:
                    child.reader.join(timeout=5)
                if child.log is not None:
                    child.log.close()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _check_alive(self, child: Child, when: str) -> None:
        code = child.proc.poll()
        if code is not None:
            if child.reader is not None:
                child.reader.join(timeout=5)
            raise ProcessFailed(
                f"{child.spec.name} exited with status {code} {when}; its last lines:\n"
                f"{child.last_lines()}",
                name=child.spec.name,
                returncode=code,
            )

    def _check_health(self, child: Child, when: str) -> None:
        """Probe a ready child's `health_url` every `_PROBE_S`; fail once it has answered no
        200 for `unhealthy_after_s` (the process may still run: it is stopped with the rest)."""
        url, now = child.spec.health_url, time.monotonic()
        if url is None or not child.ready.is_set() or now < child.next_probe:
            return
        child.next_probe = now + _PROBE_S
        failure = _health_failure(url)
        if failure is None:
            child.unhealthy_since = None
            return
        if child.unhealthy_since is None:
            child.unhealthy_since = now
        since = child.unhealthy_since
        if now - since >= child.spec.unhealthy_after_s:
            raise ProcessFailed(
                f"{child.spec.name} is unhealthy: {url} {failure} for {now - since:.0f} s "
                f"{when}; its last lines:\n{child.last_lines()}",
                name=child.spec.name,
            )

    def _read(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for raw in iter(child.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n").rsplit("\r", 1)[-1]
            child.tail.append(line)
            if child.log is not None:
                child.log.write(line + "\n")
                child.log.flush()
            if self.verbose or child.spec.console:
                self._emit(child.spec.name, line)
            if child.spec.ready_line and child.spec.ready_line in line:
                child.ready.set()
        child.proc.stdout.close()

    def _emit(self, name: str, line: str) -> None:
        with self._lock:
            self.out.write(f"{name:>{self._width}} | {line}\n" if self.verbose else f"{line}\n")
            self.out.flush()

    def _track(self) -> None:
        """Remember every descendant, also those that started a session of their own."""
        try:
            import psutil
        except ImportError:
            return
        for child in self.children:
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process(child.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self._seen[p.pid] = p.create_time()

    def _sweep(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        left = []
        for pid, created in self._seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created:
                    left.append(p)
        if not left:
            return
        names = []
        for p in left:  # typically a vLLM worker still shutting down: a moment, then SIGKILL
            with contextlib.suppress(psutil.Error):
                names.append(f"{p.pid} {p.name()}")
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        self.say(f"stopped {len(left)} leftover process(es): {', '.join(names)}", detail=True)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _health_failure(url: str, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
    """How a probe of `url` failed (one line), None if it answered 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"answered {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except TimeoutError:
        return f"did not answer in {timeout_s:g} s"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"could not be reached ({reason})"


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
