"""The trainer's environments: what `--env` names, played through TRL's `environment_factory`.

- `sessions`: any OpenEnv server as a text tool, and Wordle (`OpenEnvSession`, the class a user's
  own environment subclasses, is importable from here);
- `mcp_tools`: one typed TRL tool per MCP tool of a server;
- `openenv_inspect`: what a server takes, asked over its own API before training;
- `spec`: `--env` turned into an `environment_factory`, checked before training;
- `client`: OpenEnv's client, closing sessions and sending an API key;
- `warmup`: the format warm-up for a model that cannot call tools yet;
- `report`: what an environment run taught.
"""

from .sessions import ENVIRONMENTS, OpenEnvSession

__all__ = ["ENVIRONMENTS", "OpenEnvSession"]
