"""Root conftest: its folder (tests/) goes on sys.path, so test modules can import the shared
helpers in `model_steps.py`. (Conftest modules all share the import name `conftest`, so they are
not importable helpers themselves.)

Under pytest-xdist (README's test command: `-n 2`) the hooks below share the machine between the
workers (`machine_share`): module-sized work units, the longest queued first, each worker and
what it starts on its own cores, and `whole_machine` tests alone on all of them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from machine_share import (
    BIND_ENV,
    WHOLE_MACHINE,
    MachineLock,
    affinity,
    on_cores,
    queue_rank,
    unit_of,
    worker_cores,
)

# An example's time depends on what runs beside it: no per-example deadline.
settings.register_profile("shared-machine", deadline=None)
settings.load_profile("shared-machine")

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... (None: not under xdist)
_USER_BIND = os.environ.get(BIND_ENV)
_MACHINE = affinity()  # the cores a `whole_machine` test gets back
# One folder per run, the same for its workers (xdist gives them the run's id).
_LOCK = (
    None
    if WORKER is None
    else MachineLock(
        Path(tempfile.gettempdir()) / f"pytest-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    )
)


def pytest_configure() -> None:
    """Under xdist: this worker, what it starts, and its vLLM engines on its own cores."""
    if WORKER is not None:
        workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        cores = worker_cores(int(WORKER[2:]), workers, _MACHINE)
        os.sched_setaffinity(0, {int(core) for core in cores.split(",")})
        if _USER_BIND is None:
            os.environ[BIND_ENV] = cores


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest units first, the `whole_machine` unit last; the same order on every worker
    (xdist checks it). A `whole_machine` test outside the listed units is refused: its worker would
    wait for the other's test, and the other for it."""
    stray = [
        item.nodeid
        for item in items
        if item.get_closest_marker(WHOLE_MACHINE) and unit_of(item.nodeid) != WHOLE_MACHINE
    ]
    if stray:
        raise pytest.UsageError(
            f"whole_machine tests outside machine_share.WHOLE_MACHINE_UNITS: {stray}"
        )
    slow = {unit_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: queue_rank(item.nodeid, unit_of(item.nodeid) in slow))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Units of work as `machine_share.unit_of` says, queued in collection order (xdist would
    sort them by their number of tests)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def _alone(item: pytest.Item | None) -> bool:
    """Whether `item` runs with nothing beside it, on all the cores: marked `whole_machine`."""
    return item is not None and item.get_closest_marker(WHOLE_MACHINE) is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The lock is held from the item's setup (module and session fixtures included: servers
    start there) to its teardown, and an exclusive hold into the next item if that one runs
    alone too."""
    if _LOCK is None:
        return (yield)
    alone = _alone(item)
    if _LOCK.held and not (alone and _LOCK.exclusive):
        _LOCK.release()
    if not _LOCK.held:
        _LOCK.acquire(exclusive=alone)
    try:
        with _bind_for(alone):
            return (yield)
    finally:
        if not (alone and _alone(nextitem)):
            _LOCK.release()


@contextlib.contextmanager
def _bind_for(alone: bool) -> Iterator[None]:
    """A test alone runs on all the cores and sees the user's own binding (none: launch.py
    splits the cores, one engine takes vLLM's `auto`), as in a run without xdist."""
    if not alone:
        yield
        return
    bound = None if _USER_BIND is not None else os.environ.pop(BIND_ENV, None)
    try:
        with on_cores(_MACHINE):
            yield
    finally:
        if bound is not None:
            os.environ[BIND_ENV] = bound
