"""The strict checks every record shares (manifest, file metadata, sync records, the server's
messages): JSON gives `true` where an integer belongs, and Python's bool is an int."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_int", "is_number", "keys_exactly"]


def is_int(value: Any, *, minimum: int | None = None, maximum: int | None = None) -> bool:
    """An int that is not a bool, within [minimum, maximum] where given."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def is_number(value: Any, *, finite: bool = True) -> bool:
    """An int or float that is not a bool (finite unless `finite=False`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def keys_exactly(raw: Any, keys: set[str] | frozenset[str]) -> bool:
    """A JSON object holding exactly `keys`: no field missing, none this reader does not know."""
    return isinstance(raw, dict) and set(raw) == set(keys)
