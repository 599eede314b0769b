"""What an OpenEnv server takes, asked over its own API before training: `/schema` (the action
shape), `/metadata` (name, description) and, for MCP-tool servers, the tools (`list_tools` in a
WebSocket session: reset plus one harmless step on the path rollouts use)."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any

from .mcp_tools import ToolSpec

__all__ = ["EnvSetupError", "ServerInfo", "action_problem", "check_action", "inspect_server"]

TEXT_ACTION = {"message": "hello"}  # what the TextArena-shaped sessions send
_MCP_ACTIONS = {"CallToolAction", "ListToolsAction", "Action"}  # OpenEnv routes MCP steps to these


class EnvSetupError(ValueError):
    """The environment cannot be played as asked; the message is one line and says the fix."""


@dataclass(frozen=True)
class ServerInfo:
    """An OpenEnv server: TextArena-shaped when `tools` is empty, else its MCP tools."""

    url: str
    name: str
    description: str
    tools: tuple[ToolSpec, ...] = ()


def _get(url: str, path: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (OSError, ValueError) as exc:  # URLError, HTTPError and timeouts are OSErrors
        raise EnvSetupError(f"{url} answers no OpenEnv GET {path} ({exc})") from None
    if not isinstance(data, dict):
        raise EnvSetupError(f"{url}: GET {path} is not a JSON object")
    return data


def action_problem(schema: dict[str, Any], action: dict[str, Any]) -> str | None:
    """Why the server's action schema refuses `action` (None when it fits)."""
    from jsonschema import exceptions, validators

    validator = validators.validator_for(schema)(schema)
    error = exceptions.best_match(validator.iter_errors(action))
    return None if error is None else error.message


def _fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required") or ())
    props = schema.get("properties") or {}
    shown = [
        f"{name}: {prop.get('type', 'any') if isinstance(prop, dict) else 'any'}"
        + ("" if name in required else " (optional)")
        for name, prop in props.items()
        if name != "metadata"
    ]
    return "{" + ", ".join(shown) + "}"


def check_action(url: str, action: dict[str, Any], timeout: float = 15.0) -> None:
    """Refuse, in one line, an action the server at `url` would not accept."""
    schema = _get(url, "/schema", timeout).get("action") or {}
    problem = action_problem(schema, action)
    if problem is not None:
        raise EnvSetupError(
            f"{url} takes actions {_fields(schema)}, not {json.dumps(action)} ({problem}); "
            "write a session class for it (README: Use another OpenEnv environment) and pass "
            "--env package.module:Class"
        )


def _list_tools(url: str, timeout: float, api_key: str | None) -> tuple[ToolSpec, ...]:
    from websockets.exceptions import WebSocketException

    from .client import env_client

    client = env_client(url, api_key, message_timeout_s=timeout).sync()
    try:
        client.connect()
        client.reset()
        observation = client.step({"type": "list_tools"}).observation
    except (OSError, RuntimeError, ValueError, WebSocketException) as exc:
        raise EnvSetupError(f"{url}: listing its MCP tools failed ({exc})") from None
    finally:
        client.close()
    tools = observation.get("tools") if isinstance(observation, dict) else None
    if not tools:
        raise EnvSetupError(f"{url} lists no MCP tools; a session class can play it (--env M:C)")
    try:
        return tuple(ToolSpec.from_dict(t) for t in tools)
    except ValueError as exc:
        raise EnvSetupError(f"{url}: {exc}") from None


def inspect_server(url: str, timeout: float = 15.0, api_key: str | None = None) -> ServerInfo:
    """Classify the server at `url`; refuse in one line one that neither shape fits."""
    if not url.startswith(("http://", "https://")):
        raise EnvSetupError(f"--env-url {url!r} is not an http(s):// URL")
    action = _get(url, "/schema", timeout).get("action") or {}
    meta = _get(url, "/metadata", timeout)
    name, description = str(meta.get("name") or ""), str(meta.get("description") or "")
    if action_problem(action, TEXT_ACTION) is None:
        return ServerInfo(url, name, description)
    props = action.get("properties") or {}
    if action.get("title") in _MCP_ACTIONS or "tool_name" in props:
        return ServerInfo(url, name, description, _list_tools(url, timeout, api_key))
    raise EnvSetupError(
        f"{url} takes actions {_fields(action)}: neither a TextArena message "
        '({"message": str}) nor MCP tool calls; write a session class for it (README: Use '
        "another OpenEnv environment) and pass --env package.module:Class"
    )
