"""One way to compile the hot loops: numba, GIL released, compiled code cached on disk.

The cache goes to the package's `__pycache__` or else the user's cache directory; where neither is
writable (a read-only image with no home), numba refuses `cache=True` at import, so the loop is
compiled once per process instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numba

__all__ = ["compiled"]


def compiled(function: Callable) -> Callable:
    """`numba.njit` for a loop over numpy arrays that runs in worker threads."""
    try:
        return numba.njit(nogil=True, boundscheck=False, cache=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(function)
