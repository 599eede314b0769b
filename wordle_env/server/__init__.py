"""Wordle OpenEnv server: the environment here; the app, ``app`` and ``main`` in ``.app``.

The app is not imported here, so that ``python -m wordle_env.server.app`` runs it cleanly.
"""

from wordle_env.server.environment import WordleEnvironment

__all__ = ["WordleEnvironment"]
