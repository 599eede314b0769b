"""Wordle as an OpenEnv environment in TextArena's ``Wordle-v0`` wire format.

Server: ``python -m wordle_env.server`` or ``uvicorn wordle_env.server.app:app``; client:
``WordleEnv`` (see ``wordle_env.client``). This folder is also an OpenEnv package
(``openenv.yaml``, ``pyproject.toml``, ``uv.lock``): ``openenv validate wordle_env`` passes.
"""

from wordle_env.client import WordleEnv
from wordle_env.models import WordleAction, WordleMessage, WordleObservation, WordleState

__all__ = ["WordleAction", "WordleEnv", "WordleMessage", "WordleObservation", "WordleState"]
