"""One TRL tool per MCP tool of an OpenEnv server, typed from the tool's input schema.

TRL shows the model a method's name, Google docstring and type hints (`get_json_schema`) and
calls it with the parsed arguments. For a server's MCP tools that means one method per tool with
a real signature: `tool_methods` builds them from the JSON schemas `tools/list` returns
(integer -> int, enum -> Literal, nullable -> `X | None`, ...), and `mcp_session` makes the
session class that owns them. TRL's rollout worker is a spawned process, so the factory is
`functools.partial(mcp_session, base_url, tools, name)` (plain data): the class is rebuilt there.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from .sessions import OpenEnvSession

__all__ = ["MCPSession", "ToolSpec", "mcp_session", "tool_methods"]

log = logging.getLogger(__name__)

_TYPES = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}
_LITERALS = (str, int, float, bool, type(None))
# public attributes a tool must not shadow
_SESSION_STATE = ("base_url", "api_key", "reward", "done")


@dataclass(frozen=True)
class ToolSpec:
    """An MCP tool as `tools/list` describes it (plain data: it travels to the rollout worker)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> ToolSpec:
        """Parse one entry of a tools list (`input_schema`, or MCP's own `inputSchema`)."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise ValueError(f"a tool needs a name: {data!r:.200}")
        schema = data.get("input_schema", data.get("inputSchema")) or {}
        if not isinstance(schema, dict) or not isinstance(schema.get("properties", {}), dict):
            raise ValueError(f"tool {data['name']!r}: input schema is not an object")
        return cls(data["name"], str(data.get("description") or ""), schema)


def _hint(schema: Any) -> Any:
    """The Python type hint that TRL turns back into this JSON schema (Any when unknown)."""
    if not isinstance(schema, dict):
        return Any
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values and all(type(v) in _LITERALS for v in values):
        return Literal[tuple(values)]
    options = schema.get("anyOf") or schema.get("oneOf")
    kind = schema.get("type")
    if isinstance(kind, list):
        options = [{**schema, "type": k} for k in kind]
    if options:
        return Union[tuple(_hint(option) for option in options)]  # noqa: UP007 (built at run time)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return list[_hint(schema["items"])]
    return _TYPES.get(kind, Any)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _docstring(spec: ToolSpec, properties: dict[str, Any]) -> str:
    """A Google docstring: the tool's description and one line per argument (TRL needs each)."""
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    # FastMCP 2 keeps a tool function's whole docstring as its description, Args included.
    summary, documented, _ = parse_google_format_docstring(spec.description.strip())
    lines = [summary or f"The {spec.name} tool.", "", "Args:"]
    for name, schema in properties.items():
        schema = schema if isinstance(schema, dict) else {}
        text = schema.get("description") or (documented or {}).get(name) or schema.get("title")
        lines.append(f"    {name}: {_one_line(str(text or name))}")
    return "\n".join(lines if properties else lines[:1])


def _method(spec: ToolSpec) -> Callable[..., str]:
    """`def <tool>(self, *, arg: type, ...) -> str` that sends the call to the server."""
    properties = spec.input_schema.get("properties") or {}
    required = set(spec.input_schema.get("required") or ())
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, schema in properties.items():
        default = inspect.Parameter.empty
        if name not in required:
            default = schema.get("default") if isinstance(schema, dict) else None
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=_hint(schema)
            )
        )
    signature = inspect.Signature(params, return_annotation=str)

    def tool(self: MCPSession, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(self, *args, **kwargs)  # TypeError: TRL counts a failed call
        return self._call(spec.name, {k: v for k, v in bound.arguments.items() if k != "self"})

    tool.__name__ = tool.__qualname__ = spec.name
    tool.__doc__ = _docstring(spec, properties)
    tool.__signature__ = signature  # type: ignore[attr-defined]
    tool.__annotations__ = {p.name: p.annotation for p in params[1:]} | {"return": str}
    return tool


def tool_methods(tools: tuple[ToolSpec, ...]) -> dict[str, Callable[..., str]]:
    """A method per tool that TRL can show and call; a tool that cannot be one is left out
    with a warning (a reserved or private name, a parameter that is no Python identifier)."""
    reserved = {n for n in dir(MCPSession) if not n.startswith("_")} | set(_SESSION_STATE)
    methods = {}
    for spec in tools:
        try:
            if spec.name in reserved or spec.name.startswith("_") or spec.name in methods:
                raise ValueError("the name is taken by the session or another tool")
            methods[spec.name] = _method(spec)
        except (ValueError, TypeError) as exc:  # inspect.Parameter refuses bad names
            log.warning("MCP tool %r left out: %s", spec.name, exc)
    return methods


class MCPSession(OpenEnvSession):
    """An OpenEnv session whose tools are the server's MCP tools (`call_tool` steps over the
    session's WebSocket). The reward is the sum of the `reward` of every step's observation."""

    def __init__(
        self,
        base_url: str,
        tools: tuple[ToolSpec, ...] = (),
        name: str = "",
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, api_key)
        self._tools, self._name = tools, name

    def _text(self, observation: dict[str, Any]) -> str:
        """The reset observation for the prompt: its text alone when it has one field and that
        is text (a task), else one `name: value` line per field."""
        shown = {k: v for k, v in observation.items() if v not in (None, "", [], {})}
        if len(shown) == 1 and isinstance(text := next(iter(shown.values())), str):
            return "\n\n" + text
        lines = [f"{k}: {v}" for k, v in shown.items()]
        return "\n\n" + "\n".join(lines) if lines else ""

    def _call(self, tool: str, arguments: dict[str, Any]) -> str:
        if self.done:
            return "The episode is over."
        action = {"type": "call_tool", "tool_name": tool, "arguments": arguments}
        result = self._step_result(action)
        self.reward += float(result.reward or 0.0)
        self.done = bool(result.done)
        if self.done:
            self._close()
        return _result_text(result.observation)

    def __reduce__(self) -> tuple:
        return mcp_session, (self.base_url, self._tools, self._name, self.api_key)


def _result_text(observation: dict[str, Any]) -> str:
    """What the tool returned, as text; a tool error raises (TRL counts a failed call)."""
    error = observation.get("error")
    if error:
        raise RuntimeError(error.get("message", error) if isinstance(error, dict) else error)
    result = observation.get("result")
    if not isinstance(result, dict):
        return "" if result is None else str(result)
    texts = [c.get("text", "") for c in result.get("content") or () if isinstance(c, dict)]
    text = "\n".join(t for t in texts if t)
    if result.get("is_error") or result.get("isError"):
        raise RuntimeError(text or "the tool reported an error")
    if text:
        return text
    data = result.get("data", result.get("structured_content"))
    return json.dumps(data) if data is not None else ""


_CLASSES: dict[str, type[MCPSession]] = {}  # one class per tool set and process: TRL keys
# an environment's reward column by its class


def mcp_session(
    base_url: str, tools: tuple[ToolSpec, ...], name: str = "", api_key: str | None = None
) -> MCPSession:
    """A session of the server at `base_url` whose public methods are `tools`."""
    key = json.dumps([name, [vars(t) for t in tools]], sort_keys=True, default=str)
    cls = _CLASSES.get(key)
    if cls is None:
        title = "".join(p[:1].upper() + p[1:] for p in re.split(r"[^A-Za-z0-9]+", name) if p)
        cls_name = f"{title}Tools" if title[:1].isalpha() else "OpenEnvTools"
        cls = _CLASSES[key] = type(cls_name, (MCPSession,), dict(tool_methods(tools)))
        cls.__module__ = __name__
    return cls(base_url, tools, name, api_key)
