"""How parallel test workers share the machine (`machine_share`): the lock across processes,
the cores each worker's engines get, and the queue order."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from machine_share import (
    LONGEST_FIRST,
    SPLIT_MODULES,
    WHOLE_MACHINE,
    WHOLE_MACHINE_UNITS,
    MachineLock,
    affinity,
    on_cores,
    queue_rank,
    unit_of,
    worker_cores,
)

WAIT_S = 30.0


def _hold(folder: str, exclusive: bool, hold_s: float, release) -> None:
    """Hold the lock for `hold_s`, or until `release` is set if one is given; each entry and
    exit is appended to `events` in the folder before going on (one write, in order)."""
    lock = MachineLock(Path(folder))
    kind = "x" if exclusive else "s"
    fd = os.open(Path(folder) / "events", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        lock.acquire(exclusive=exclusive)
        os.write(fd, f"in {kind}\n".encode())
        if release is None:
            time.sleep(hold_s)
        else:
            release.wait(WAIT_S)
        os.write(fd, f"out {kind}\n".encode())
        lock.release()
    finally:
        os.close(fd)


def _spawn(ctx, tmp_path: Path, exclusive: bool, hold_s: float = 0.1, release=None):
    proc = ctx.Process(target=_hold, args=(str(tmp_path), exclusive, hold_s, release))
    proc.start()
    return proc


def _wait_until_held(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    with path.open("a") as probe:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(probe, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError(f"nobody took {path}")


def _events(tmp_path: Path, count: int) -> list[tuple[str, str]]:
    """The first `count` events, once there are that many."""
    deadline = time.monotonic() + WAIT_S
    path = tmp_path / "events"
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= 2 * count:
            return list(zip(lines[0 : 2 * count : 2], lines[1 : 2 * count : 2], strict=True))
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} events in {path}")


def test_shared_holders_overlap_and_an_exclusive_one_runs_alone(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    release = ctx.Event()
    shared = _spawn(ctx, tmp_path, False, release=release)
    second = _spawn(ctx, tmp_path, False, release=release)
    assert _events(tmp_path, 2) == [("in", "s"), ("in", "s")]  # both in at once
    alone = _spawn(ctx, tmp_path, True)
    _wait_until_held(tmp_path / "machine.turnstile")
    release.set()
    rest = _events(tmp_path, 6)[2:]
    for proc in (shared, second, alone):
        proc.join(WAIT_S)
        assert proc.exitcode == 0
    # the exclusive holder entered only once both shared ones had left, and left last
    assert rest == [("out", "s"), ("out", "s"), ("in", "x"), ("out", "x")]


def test_a_waiting_exclusive_holder_goes_before_later_shared_ones(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    release = ctx.Event()
    first = _spawn(ctx, tmp_path, False, release=release)
    assert _events(tmp_path, 1) == [("in", "s")]
    alone = _spawn(ctx, tmp_path, True)
    _wait_until_held(tmp_path / "machine.turnstile")  # it waits for the first to leave
    late = _spawn(ctx, tmp_path, False)
    time.sleep(0.5)  # let it queue (were it admitted now, the order below would show it)
    release.set()
    order = _events(tmp_path, 6)
    for proc in (first, alone, late):
        proc.join(WAIT_S)
        assert proc.exitcode == 0
    assert order == [
        ("in", "s"),
        ("out", "s"),
        ("in", "x"),
        ("out", "x"),
        ("in", "s"),
        ("out", "s"),
    ]


def test_each_worker_gets_its_own_cores():
    assert [worker_cores(w, 2, [0, 1]) for w in range(2)] == ["0", "1"]
    assert [worker_cores(w, 2, [3, 2, 1, 0]) for w in range(2)] == ["0,1", "2,3"]
    assert [worker_cores(w, 3, [0, 1]) for w in range(3)] == ["0", "1", "0"]  # round-robin


AFFINITY = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"


def _child_affinity() -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", AFFINITY], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


def test_on_cores_holds_the_process_and_what_it_starts():
    before = affinity()
    with on_cores(before[:1]):
        assert affinity() == before[:1] and _child_affinity() == before[:1]
    assert affinity() == before and _child_affinity() == before


def test_a_worker_and_what_it_starts_run_on_its_own_cores():
    """Under README's `-n 2` this test's worker is on its share of the cores that pytest itself
    (the worker's parent) has, and so is every process it starts; without xdist, the machine."""
    assert _child_affinity() == affinity()
    machine = os.sched_getaffinity(os.getppid()) if "PYTEST_XDIST_WORKER" in os.environ else None
    if machine is not None and len(machine) > 1:
        assert set(affinity()) < machine


def test_the_longest_units_first_and_the_whole_machine_unit_last():
    tests = [
        f"{WHOLE_MACHINE_UNITS[1]}::test_a",
        f"{WHOLE_MACHINE_UNITS[0]}::test_b",
        "tests/a_fast.py::test_c",
        "tests/b_slow.py::test_d",
        f"{LONGEST_FIRST[1]}::test_e[1]",
        f"{LONGEST_FIRST[0]}::test_f",
    ]
    slow = {unit_of(t) for t in tests if "fast" not in t}
    ordered = sorted(tests, key=lambda t: queue_rank(t, unit_of(t) in slow))
    assert ordered == [tests[5], tests[4], tests[3], tests[2], tests[1], tests[0]]


def test_units_are_modules_but_for_split_modules_folder_units_and_the_whole_machine_one():
    assert unit_of("tests/a/test_x.py::test_y[1]") == "tests/a/test_x.py"
    split = f"{SPLIT_MODULES[0]}::test_family[llama]"
    assert unit_of(split) == split
    assert unit_of("tests/folder_unit/test_x.py::test_y") == "tests/folder_unit/test_x.py"
    assert all(unit_of(f"{m}::test_y") == WHOLE_MACHINE for m in WHOLE_MACHINE_UNITS)
    assert unit_of("tests/scale/test_fsdp_publish.py::test_z") == WHOLE_MACHINE  # its folder's
