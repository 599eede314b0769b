"""Compiled loops are cached on disk where possible and still work where numba cannot cache."""

from __future__ import annotations

import numpy as np
from numba.core.caching import FunctionCache, NullCache

from deltasync.kernels.bitscan import _scan
from deltasync.kernels.jit import compiled


def test_library_loops_are_cached_on_disk():
    assert isinstance(_scan._cache, FunctionCache)


def test_a_function_numba_cannot_cache_is_compiled_per_process():
    namespace: dict = {}
    source = "def total(values):\n    s = 0\n    for v in values:\n        s += v\n    return s"
    exec(source, namespace)
    # Defined in no file, so numba's cache=True raises "no locator available" for it.
    total = compiled(namespace["total"])
    assert isinstance(total._cache, NullCache)
    assert total(np.arange(10, dtype=np.int64)) == 45
