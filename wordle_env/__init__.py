"""Wordle as an OpenEnv environment in TextArena's ``Wordle-v0`` wire format.

Server: ``python -m wordle_env.server``; client: ``WordleEnv`` (see ``wordle_env.client``).
"""

from wordle_env.client import WordleEnv
from wordle_env.models import WordleAction, WordleMessage, WordleObservation, WordleState

__all__ = ["WordleAction", "WordleEnv", "WordleMessage", "WordleObservation", "WordleState"]
