"""The trainer's console: one line per version on the terminal, everything else in a log file.

A run's raw output is thousands of lines (vLLM's and TRL's warnings, TRL's metric dicts, the
rollout worker's output, native libraries' reports at exit); what matters per version is a step,
a reward, a delta's size and sparsity and each replica's latency and pause. `quiet_output`
points the process's own file descriptors 1 and 2 at the log file - so C libraries and TRL's
spawned rollout worker, which inherit them, land there too - and keeps the terminal for the
`console` logger.
Verbose, the descriptors go through a pipe that a thread copies to both. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from deltasync.wire.metrics import ReplicaOutcome, SyncRecord

__all__ = ["console", "last_lines", "latency_summary", "quiet_output", "version_line"]

console = logging.getLogger("trainer.console")
_FORMAT = "%(asctime)s %(name)s: %(message)s"


def version_line(record: SyncRecord) -> str:
    """`v7 step 6 reward 0.148 | delta 61.0 KB, 53x smaller, 96.2% unchanged | serving vllm-0
    1.20 s (paused 0.04 s), follower-0 1.50 s (following)`; a record without latencies (written
    before they were measured) shows `paused vllm-0 0.04 s`."""
    head = f"v{record.version:<3d}"
    head += f" step {record.step:<3d}" if record.step is not None else " " * 9
    reward = "-" if record.reward_mean is None else f"{record.reward_mean:.3f}"
    head += f" reward {reward:>5}"
    if record.has_delta:
        smaller = record.full_bytes / max(record.delta_bytes, 1)
        payload = f"delta {_size(record.delta_bytes)}, {smaller:.0f}x smaller"
        if record.has_anchor:
            payload += f" (+ anchor {_size(record.anchor_bytes)})"
        payload += f", {100 * record.sparsity:.1f}% unchanged"
    elif 100 * record.anchor_bytes < record.full_bytes:  # too small to hold the weights
        payload = f"anchor {_size(record.anchor_bytes)}: names the checkpoint, no weights uploaded"
    else:
        payload = f"anchor {_size(record.anchor_bytes)} (full bf16 weights)"
    measured = any(r.latency_s is not None for r in record.replicas)
    replicas = ", ".join(_replica(r, record.version) for r in record.replicas)
    label = "serving" if measured else "paused"
    return " | ".join(p for p in (head, payload, replicas and f"{label} {replicas}") if p)


def _replica(outcome: ReplicaOutcome, version: int) -> str:
    """One replica's part: its commit-to-serving latency and its own pause (a superseded
    version had none: its replica's one real pause is on the newer version's line)."""
    if not outcome.ok:
        return f"{outcome.name} LAGGING"
    if outcome.latency_s is None:
        return f"{outcome.name} {outcome.pause_s:.2f} s"
    if outcome.following:
        how = "following"
    elif outcome.superseded(version):
        how = f"superseded by v{outcome.served_version}: nothing applied"
    else:
        how = f"paused {outcome.pause_s:.2f} s"
    return f"{outcome.name} {outcome.latency_s:.2f} s ({how})"


def latency_summary(records: Iterable[SyncRecord]) -> str:
    """`commit-to-serving latency p50 / p95: vllm-0 1.20 / 2.31 s, ...` over every version each
    replica served (followers: to within the poll interval); empty without any."""
    latencies: dict[str, list[float]] = {}
    for record in records:
        for r in record.replicas:
            if r.latency_s is not None:
                latencies.setdefault(r.name, []).append(r.latency_s)
    shown = ", ".join(
        f"{name} {_percentile(values, 0.5):.2f} / {_percentile(values, 0.95):.2f} s"
        for name, values in latencies.items()
    )
    return shown and f"commit-to-serving latency p50 / p95: {shown}"


def _percentile(values: list[float], q: float) -> float:
    """Nearest rank: a value that occurred, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


@contextlib.contextmanager
def quiet_output(log_file: Path, *, verbose: bool) -> Iterator[None]:
    """All output (logging at INFO, prints, native libraries, child processes) into `log_file`,
    and also on the terminal when `verbose`; `console` lines on the terminal either way.

    Leaving restores the file descriptors.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    sink = log_file.open("ab", buffering=0)
    tee = _Tee(sink, terminal) if verbose else None
    target = tee.write_end if tee is not None else sink.fileno()
    os.dup2(target, 1)
    os.dup2(target, 2)
    if tee is not None:
        os.close(target)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # fd 2: the file (and the terminal)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    shown = logging.StreamHandler(terminal)  # quiet: the terminal's only lines
    shown.setFormatter(logging.Formatter("%(message)s"))
    if tee is None:
        console.addHandler(shown)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        console.removeHandler(shown)
        root.removeHandler(handler)
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        if tee is not None:
            tee.thread.join(timeout=1.0)  # children still holding the pipe keep it open
        sink.close()
        terminal.close()


class _Tee:
    """A pipe whose every byte a daemon thread copies to `sink` and `terminal`; `write_end` is
    what fds 1 and 2 become."""

    def __init__(self, sink: BinaryIO, terminal: TextIO):
        read_end, self.write_end = os.pipe()
        self.thread = threading.Thread(
            target=self._copy, args=(read_end, sink, terminal), name="console-tee", daemon=True
        )
        self.thread.start()

    @staticmethod
    def _copy(read_end: int, sink: BinaryIO, terminal: TextIO) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            for chunk in iter(lambda: pipe.read(65536), b""):
                try:
                    sink.write(chunk)
                    terminal.write(chunk.decode("utf-8", "replace"))
                    terminal.flush()
                except (OSError, ValueError):  # closed at exit while a child still wrote
                    return


def last_lines(log_file: Path, n: int = 15) -> str:
    """The log's last `n` lines, indented, for an error on the terminal."""
    try:
        with log_file.open(encoding="utf-8", errors="replace") as f:
            tail = deque(f, maxlen=n)
    except OSError:
        return ""
    return "".join(f"    {line}" for line in tail).rstrip("\n")
