"""The trainer's `--env`, turned into a TRL `environment_factory` and checked before training.

`--env` is a registered name (`wordle`, `openenv` = the server at `--env-url`), an OpenEnv
server URL, or `package.module:Class`. A URL is inspected (`openenv_inspect`): TextArena-shaped
servers get the `act` tool, MCP-tool servers one tool per server tool (`mcp_tools`). A class is
imported from the current folder or PYTHONPATH (TRL's spawned rollout worker inherits both);
its `__init__` gets `base_url=--env-url` (and `api_key=--env-api-key`) when it takes them.
The pre-flight builds one session, checks the action shape, resets it and renders every tool
as TRL will, so a mismatch is a one-line error now instead of a run of zero rewards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

from .mcp_tools import MCPSession, mcp_session
from .openenv_inspect import EnvSetupError, check_action, inspect_server
from .sessions import ENVIRONMENTS, OpenEnvSession

__all__ = [
    "EnvSetupError",
    "EnvSpec",
    "dataset_rows",
    "env_arg",
    "preflight",
    "resolve",
    "session_tools",
]

CLASS_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_LAST_REWARD = "the server's `reward` of the episode's last step"


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What `--env` resolved to: a picklable session factory, the rollouts' prompt, and where
    the reward comes from (said in the log and in the end-of-run report)."""

    env: str
    factory: Callable[[], Any]
    prompt: str
    reward: str
    tools: tuple[str, ...] = ()  # filled by the pre-flight


def env_arg(value: str) -> str:
    """argparse `type=` for --env: refuse, in one line, what is none of the accepted forms."""
    known = ("sanity", *ENVIRONMENTS)
    if value in known or value.startswith(("http://", "https://")) or CLASS_REF.fullmatch(value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is none of {', '.join(known)}, an OpenEnv URL (http[s]://...) or "
        "package.module:Class"
    )


def _load_class(ref: str) -> type:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        where = f"{os.getcwd()} or PYTHONPATH"
        if isinstance(exc, ModuleNotFoundError) and module_name.startswith(exc.name or "\0"):
            raise EnvSetupError(
                f"--env {ref}: no module {exc.name!r} in {where}; run from the folder that "
                "holds it or add that folder to PYTHONPATH"
            ) from None
        raise EnvSetupError(f"--env {ref}: importing {module_name} failed: {exc}") from None
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise EnvSetupError(f"--env {ref}: {module_name} has no class {attr} with a reset method")
    return cls


def _class_spec(env: str, cls: type, env_url: str, api_key: str | None) -> EnvSpec:
    takes = inspect.signature(cls).parameters
    given = {"base_url": env_url, "api_key": api_key}
    given = {k: v for k, v in given.items() if k in takes and v is not None}
    factory = functools.partial(cls, **given) if given else cls
    inherited = issubclass(cls, OpenEnvSession) and cls.get_reward is OpenEnvSession.get_reward
    reward = _LAST_REWARD if inherited else f"{cls.__qualname__}.get_reward()"
    reward = getattr(cls, "reward_source", None) or reward
    prompt = getattr(cls, "prompt", None) or "Use your tools until the task is done."
    return EnvSpec(env, factory, prompt, reward)


def resolve(env: str, env_url: str, api_key: str | None = None) -> EnvSpec:
    """The session factory of `--env` (a server URL is inspected; a class is imported).

    `api_key` goes only to that server (`--env-url` or the URL in `--env`), and to a class only
    when its `__init__` takes `api_key`.
    """
    if CLASS_REF.fullmatch(env):
        return _class_spec(env, _load_class(env), env_url, api_key)
    if env in ENVIRONMENTS and env != "openenv":
        return _class_spec(env, ENVIRONMENTS[env], env_url, api_key)
    url = env_url if env == "openenv" else env
    info = inspect_server(url, api_key=api_key)
    if not info.tools:
        return _class_spec(env, ENVIRONMENTS["openenv"], url, api_key)
    names = ", ".join(t.name for t in info.tools)
    about = info.description or f"The {info.name or 'OpenEnv'} environment."
    return EnvSpec(
        env,
        functools.partial(mcp_session, url, info.tools, info.name, api_key),
        f"{about}\nUse the tools ({names}) until the task is done.",
        "the sum of the server's `reward` over the episode's steps",
    )


def dataset_rows(spec: EnvSpec, count: int = 4096) -> list[dict[str, Any]]:
    """One row per rollout group; TRL calls `reset(**row)` and appends what it returns."""
    return [{"prompt": [{"role": "user", "content": spec.prompt}], "seed": i} for i in range(count)]


def session_tools(session: Any) -> list[str]:
    """The names of a session's tools as TRL's rollout worker finds them: every public method
    except `reset` and `get_reward`."""
    return [
        name
        for name, _ in inspect.getmembers(type(session), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def preflight(spec: EnvSpec) -> EnvSpec:
    """Build, check and reset one session as the rollout worker will; returns `spec` with the
    session's tool names.

    Raises:
        EnvSetupError: in one line, what does not fit and the fix.
    """
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
        get_json_schema,
    )
    from websockets.exceptions import WebSocketException

    try:
        pickle.dumps(spec.factory)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise EnvSetupError(f"--env {spec.env}: TRL's worker cannot get it: {exc}") from None
    session = spec.factory()
    if not callable(getattr(session, "get_reward", None)):
        raise EnvSetupError(f"--env {spec.env}: {type(session).__name__} has no get_reward()")
    tools = session_tools(session)
    for name in tools:  # what TRL's rollout worker renders into the prompt
        try:
            get_json_schema(getattr(session, name))
        except (DocstringParsingException, TypeHintParsingException) as exc:
            raise EnvSetupError(f"--env {spec.env}: tool {name} cannot be shown: {exc}") from None
    plays = isinstance(session, OpenEnvSession) and not isinstance(session, MCPSession)
    try:
        if plays:
            check_action(session.base_url, session._action("hello"))
        session.reset(**dataset_rows(spec, 1)[0])
    except (TypeError, OSError, RuntimeError, WebSocketException) as exc:
        raise EnvSetupError(f"--env {spec.env}: reset failed: {exc}") from None
    finally:
        if isinstance(session, OpenEnvSession):
            session._close()
    return dataclasses.replace(spec, tools=tuple(tools))
