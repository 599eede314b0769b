"""Wordle OpenEnv server: the environment and the FastAPI app that serves it."""

from wordle_env.server.app import DEFAULT_MAX_CONCURRENT_ENVS, create_wordle_app
from wordle_env.server.environment import WordleEnvironment

__all__ = ["DEFAULT_MAX_CONCURRENT_ENVS", "WordleEnvironment", "create_wordle_app"]
