"""Print a benchmark's table and, when asked, keep it with its raw results as JSON."""

from __future__ import annotations

import json
import os

__all__ = ["report"]


def report(text: str, results: dict, path: str | None, *, key: str = "markdown") -> None:
    """Print `text`; with `path`, write `results` plus `text` (under `key`) there as JSON."""
    print(text)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({**results, key: text}, f, indent=1)
