"""Run a process with modules made unimportable: `without_modules(env, "torch", "numba")`."""

from __future__ import annotations

import os
from pathlib import Path

SITE = str(Path(__file__).parent)
UNIMPORTABLE = ("torch", "numba", "safetensors.torch")  # the tensor side


def without_modules(env: dict[str, str], *names: str) -> dict[str, str]:
    """`env` for a child process in which `names` cannot be imported (its own children can)."""
    path = os.pathsep.join(filter(None, [SITE, env.get("PYTHONPATH", "")]))
    return env | {"PYTHONPATH": path, "DELTASYNC_TEST_UNIMPORTABLE": ",".join(names)}
