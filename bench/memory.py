"""Peak resident memory of a process tree while a block runs, sampled every 20 ms."""

from __future__ import annotations

import threading
from contextlib import suppress

import psutil

__all__ = ["PeakRss"]


class PeakRss:
    """`with PeakRss(psutil.Process(pid)) as rss: ...`, then `rss.extra` = peak - start bytes.

    With `tree=False` only the process itself is read: walking /proc for children costs CPU that
    a benchmark of the same process would otherwise get.
    """

    def __init__(self, root: psutil.Process, interval_s: float = 0.02, *, tree: bool = True):
        self.root, self.interval_s, self.tree = root, interval_s, tree
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> int:
        total = 0
        for proc in [self.root, *(self.root.children(recursive=True) if self.tree else ())]:
            with suppress(psutil.Error):  # a process ended between listing and reading
                total += proc.memory_info().rss
        return total

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._rss()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)
