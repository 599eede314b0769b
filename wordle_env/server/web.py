"""Guards for OpenEnv's web interface: no uploads, and ``/web/step`` input checked first."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from wordle_env.models import WordleAction
from wordle_env.server.access import read_body, replaying
from wordle_env.server.errors import bounded_errors, refusal

__all__ = ["NoUploads", "WebStepCheck"]

NO_UPLOADS = "this server takes no uploads"


class NoUploads:
    """Refuse uploads (403) before a byte of them is read: the server keeps nothing clients send.

    Gradio, mounted at ``/web`` by OpenEnv's web interface, takes ``POST /web/gradio_api/upload``
    from anyone and writes each file to its temp folder; Wordle's page has no file inputs. Any
    ``multipart/form-data`` request is refused as well: no route of this server takes a form.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_upload(scope):
            await refusal(scope["method"], scope["path"], NO_UPLOADS, 403)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _is_upload(scope: Scope) -> bool:
    if scope["path"].rstrip("/").rsplit("/", 1)[-1] == "upload":
        return True
    return Headers(scope=scope).get("content-type", "").lower().startswith("multipart/")


class WebStepCheck:
    """Validate the action in a ``POST /web/step`` body before OpenEnv's handler reads it.

    openenv-core 0.3.0's handler calls ``.get`` on ``action`` and validates only afterwards, so
    ``{"action": []}`` or ``{"message": 1e400}`` was a 500 with a traceback (and a ``tokens``
    field imported torch). Bodies are JSON objects: ``{"message": ...}`` or ``{"action": {...}}``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) != ("POST", "/web/step"):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # within its bound: `BoundedBodies` runs first
        problem = _action_problem(body or b"")
        if problem is not None:
            await refusal("POST", "/web/step", problem, 422)(scope, receive, send)
            return
        await self.app(scope, replaying(body or b"", receive), send)


def _action_problem(body: bytes) -> str | list[dict[str, Any]] | None:
    """Why the action OpenEnv would build from ``body`` is refused; None if it is a WordleAction.

    Bodies that are not JSON objects are left to FastAPI, which refuses them itself (422).
    """
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json can parse
        return None
    if not isinstance(request, dict):
        return None
    action = {"message": request["message"]} if "message" in request else request.get("action")
    if not isinstance(action, dict):
        return 'body must be {"message": ...} or {"action": {...}}'
    try:
        WordleAction.model_validate(action)
    except ValidationError as exc:
        return bounded_errors(exc.errors())
    return None
