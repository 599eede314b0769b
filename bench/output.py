"""Print a benchmark's table and, when asked, keep it with its raw results as JSON."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

__all__ = ["best_of", "report", "save_json"]


def report(text: str, results: dict, path: str | None, *, key: str = "markdown") -> None:
    """Print `text`; with `path`, write `results` plus `text` (under `key`) there as JSON."""
    print(text)
    save_json({**results, key: text}, path)


def save_json(results: object, path: str | None) -> None:
    """With `path`, write `results` there as indented JSON (creating its folder)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def best_of(fn: Callable[[], object], repeat: int) -> tuple[object, float, float]:
    """(first call's result, best wall time, best CPU time (all threads) of `repeat` calls)."""
    best, cpu, result = math.inf, math.inf, None
    for i in range(max(1, repeat)):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
        if i == 0:
            result = out
        del out
    return result, best, cpu
