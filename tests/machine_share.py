"""How tests share this machine when pytest-xdist runs them on several workers.

- Every test holds a shared lock on the machine while it runs; a test marked `whole_machine`
  (it asserts timings, a spread of work over engines or learning paced by the CPU) holds it
  exclusively, so no other test runs beside it. A turnstile lock keeps the exclusive one from
  waiting forever behind a stream of shared ones (`flock` itself is not fair).
- Each worker's vLLM engines are bound to that worker's share of the cores
  (`VLLM_CPU_OMP_THREADS_BIND`): vLLM's own `auto` binds every engine to the same first cores, so
  two workers' engines would share one core while the other sat idle. A `whole_machine` test
  gets the variable back as the user's machine has it (launch.py splits the cores itself).
- Work units are modules (a module's fixtures, servers among them, start once), except the
  modules in `SPLIT_MODULES`, whose tests are independent and long, and whose units are tests,
  and the folders in `FOLDER_UNITS`, whose modules share session fixtures (a worker builds a
  session fixture for itself). The longest units are queued first (`LONGEST_FIRST`, then the
  other slow modules), so that at the end the workers share the many short ones; the order
  never changes what a test checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "BIND_ENV",
    "LONGEST_FIRST",
    "SPLIT_MODULES",
    "MachineLock",
    "affinity",
    "queue_rank",
    "unit_of",
    "worker_cores",
]

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Modules whose tests each start their own servers and share nothing costly: a unit per test.
SPLIT_MODULES = ("tests/deltasync/vllm_ext/test_family_servers.py",)
# Folders whose modules share session fixtures (torchrun runs): one unit each.
FOLDER_UNITS = ("tests/scale/",)
# The longest units (a clean-clone `.ci/run`'s `--durations=0` on 2 cores), longest first: those
# holding `whole_machine` tests before the rest, so that those run one after another at the start
# (each waits for one test of the other worker at most) and the shared ones fill the time after.
LONGEST_FIRST = (
    "tests/trainer/test_env_learning.py",  # whole_machine
    "tests/trainer/test_train_replica_restart.py",  # whole_machine
    "tests/scale/",  # test_tp_replica is whole_machine
    "tests/launch/test_launch_local_e2e.py",  # one whole_machine test
    "tests/trainer/test_train_e2e.py",  # whole_machine
    "tests/trainer/test_replica_death.py",  # one whole_machine test
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


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, its folder or itself."""
    module = nodeid.split("::", 1)[0]
    if module in SPLIT_MODULES:
        return nodeid
    return next((f for f in FOLDER_UNITS if module.startswith(f)), module)


def queue_rank(nodeid: str, slow: bool) -> tuple[int, int]:
    """Sort key of a test's place in the queue, the same for every test of its unit (the
    split modules' tests share their module's): the listed long units, then other slow ones,
    then the rest (a stable sort keeps the collection order within each)."""
    module = nodeid.split("::", 1)[0]
    unit = module if module in SPLIT_MODULES else unit_of(nodeid)
    if unit in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(unit))
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
    """A readers-writer lock across the worker processes, on two files in `folder`."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = folder / "machine.turnstile"
        self._machine = folder / "machine.lock"

    @contextlib.contextmanager
    def hold(self, *, exclusive: bool) -> Iterator[None]:
        with self._machine.open("a") as machine:
            with self._turnstile.open("a") as turnstile:
                fcntl.flock(turnstile, fcntl.LOCK_EX)  # queued behind a waiting exclusive one
                fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(machine, fcntl.LOCK_UN)


def affinity() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))
