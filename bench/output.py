"""Print a benchmark's table and, when asked, keep it with its raw results as JSON."""

from __future__ import annotations

import json
import os

__all__ = ["report", "save_json"]


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
