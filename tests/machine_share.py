"""How tests share this machine when pytest-xdist runs them on several workers.

- Each worker, and every process it starts (servers, trainers, torchrun ranks), runs on its own
  share of the cores (`worker_cores`; the share is inherited, so a test's servers and trainer
  stay on it), and its vLLM engines are bound to that share (`VLLM_CPU_OMP_THREADS_BIND`:
  vLLM's own `auto` binds every engine to the same first cores). So two tests with real servers
  or trainers run side by side, one per core: on 2 cores four such modules took 351 s pinned
  that way against 568 s one after another, each test 1.0-1.2x its time alone, and a test
  alone used 0.65 of a core on average, its processes mostly taking turns
  (`bench/results/test_pairs.json`). Unpinned, two side by side each ran about 5x slower than
  alone: their processes spun on each other's cores.
- Every test holds a shared lock on the machine while it runs; a test marked `whole_machine`
  (it asserts timings, a spread of work over engines or learning paced by the CPU) holds it
  exclusively, on all the cores, so no other test runs beside it, and keeps holding it into
  the next test when that one runs alone too. A turnstile lock keeps an exclusive one from
  waiting forever behind a stream of shared ones (`flock` itself is not fair). A
  `whole_machine` test gets the binding back as the user's machine has it (launch.py splits the
  cores itself).
- Work units are modules (a module's fixtures, servers among them, start once), except:
  the modules in `SPLIT_MODULES`, whose tests are independent and long (a unit per test); the
  folders in `FOLDER_UNITS`, whose modules share session fixtures (a worker builds a session
  fixture for itself); and the modules in `WHOLE_MACHINE_UNITS`, which hold the `whole_machine`
  tests and make one unit, queued last: one worker runs those tests one after another while the
  other is through its queue or in a short test, instead of each of them waiting for whatever
  long test the other worker is in (queued first, each one had waited for a 1-2 minute family
  test, and that test had run alone). Before it the longest units (`LONGEST_FIRST`, then the
  other slow ones), so that the workers then share the many short ones. The order never
  changes what a test checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "BIND_ENV",
    "FOLDER_UNITS",
    "LONGEST_FIRST",
    "SPLIT_MODULES",
    "WHOLE_MACHINE",
    "WHOLE_MACHINE_UNITS",
    "MachineLock",
    "affinity",
    "on_cores",
    "queue_rank",
    "unit_of",
    "worker_cores",
]

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
WHOLE_MACHINE = "whole_machine"  # the marker, and the name of the unit of its modules
# Modules whose tests each start their own servers and share nothing costly: a unit per test.
SPLIT_MODULES = ("tests/deltasync/vllm_ext/test_family_servers.py",)
# Folders whose modules share session fixtures (torchrun runs, the Space images): one unit each.
FOLDER_UNITS = ("tests/scale/", "tests/containers/")
# Every module (or folder unit) holding a `whole_machine` test, its longest first (conftest
# refuses a marked test elsewhere).
WHOLE_MACHINE_UNITS = (
    "tests/trainer/test_train_replica_restart.py",
    "tests/scale/",
    "tests/launch/test_launch_local_e2e.py",
    "tests/trainer/test_train_e2e.py",
    "tests/trainer/test_replica_death.py",
    "tests/dashboard/test_screenshot.py",
    "tests/wordle_env/test_wordle_sessions.py",
    "tests/wordle_env/test_wordle_load.py",
    "tests/wordle_env/test_wordle_access.py",
    "tests/trainer/test_weight_sync_slow_store.py",
    "tests/trainer/test_routing.py",
    "tests/trainer/test_proxy_stops_rollouts.py",
    "tests/deltasync/store/test_store_latency.py",
    "tests/bench/test_latency_store_bench.py",
)
# The other long units (a clean-clone `.ci/run`'s `--durations=0` on 2 cores), longest first.
LONGEST_FIRST = (
    "tests/containers/",
    "tests/trainer/test_env_learning.py",
    "tests/deltasync/vllm_ext/test_family_servers.py",  # a unit per family
    "tests/deltasync/vllm_ext/test_chaos.py",
    "tests/trainer/test_train_resume.py",
    "tests/trainer/test_train_trainer_restart.py",
    "tests/trainer/test_train_envs.py",
    "tests/launch/test_launch_local_env_class.py",
    "tests/deltasync/vllm_ext/test_follow_server.py",
    "tests/deltasync/vllm_ext/test_server.py",
    "tests/deltasync/vllm_ext/test_control_plane.py",
    "tests/deltasync/vllm_ext/test_restart.py",
    "tests/bench/test_gpu_check.py",
)


def _group(nodeid: str) -> str:
    """A test's module, or the folder unit it is in."""
    module = nodeid.split("::", 1)[0]
    return next((f for f in FOLDER_UNITS if module.startswith(f)), module)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to."""
    group = _group(nodeid)
    if group in WHOLE_MACHINE_UNITS:
        return WHOLE_MACHINE
    return nodeid if group in SPLIT_MODULES else group


def queue_rank(nodeid: str, slow: bool) -> tuple[int, int]:
    """Sort key of a test's place in the queue, the same for every test of a module (a stable
    sort keeps the collection order within each): the listed long units, then other slow ones,
    then the rest, then the `whole_machine` unit."""
    group = _group(nodeid)
    if group in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(group))
    if group in WHOLE_MACHINE_UNITS:
        return (3, WHOLE_MACHINE_UNITS.index(group))
    return (1, 0) if slow else (2, 0)


def worker_cores(worker: int, workers: int, cores: list[int]) -> str:
    """The cores of `worker` (0-based) among `workers`, as `VLLM_CPU_OMP_THREADS_BIND` reads
    them: contiguous equal shares, or one core round-robin when there are fewer cores."""
    cores = sorted(cores)
    if len(cores) < workers:
        return str(cores[worker % len(cores)])
    share = cores[worker * len(cores) // workers : (worker + 1) * len(cores) // workers]
    return ",".join(map(str, share))


class MachineLock:
    """A readers-writer lock across the worker processes, on two files in `folder`; one
    process holds it in one mode at a time."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = folder / "machine.turnstile"
        self._machine = folder / "machine.lock"
        self._held: IO[str] | None = None
        self.exclusive = False

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self, *, exclusive: bool) -> None:
        assert self._held is None, "already held"
        machine = self._machine.open("a")
        with self._turnstile.open("a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # queued behind a waiting exclusive one
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        self._held, self.exclusive = machine, exclusive

    def release(self) -> None:
        if self._held is not None:
            fcntl.flock(self._held, fcntl.LOCK_UN)
            self._held.close()
            self._held = None


def affinity() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def on_cores(cores: Iterable[int]) -> Iterator[None]:
    """This process (its calling thread), and every process it starts meanwhile, on `cores`;
    the cores it had before afterwards."""
    before = affinity()
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
