"""HTTP refusals: bad input gets a 422 with a bounded body and one log line, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from wordle_env.models import InvalidResetError

__all__ = ["bounded_errors", "install_error_handlers", "refusal"]

_MAX_ERRORS = 10
_MAX_CHARS = 200
_log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    """Answer refused input with 422 instead of FastAPI's and OpenEnv's defaults.

    FastAPI's 422 echoes every input: a 100,000-character ``episode_id`` came back whole, and
    ``{"seed": 1e400}`` (infinity, which JSON cannot write) turned the 422 into a 500 with a
    traceback. OpenEnv's ``/reset`` lets the environment's ``ValueError`` become a 500 too.
    """
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(InvalidResetError, _invalid_reset)


def refusal(
    method: str, path: str, detail: str | list[dict[str, Any]], status: int = 422
) -> JSONResponse:
    """The answer to refused input: ``{"detail": ...}``, after one log line saying why."""
    if isinstance(detail, str):
        reason = detail
    else:
        reason = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in detail)
    # unicode_escape keeps the line one line whatever the client sent (newlines, control bytes).
    line = reason[: 2 * _MAX_CHARS].encode("unicode_escape").decode("ascii")
    _log.warning("%s %s refused (%d): %s", method, path, status, line)
    return JSONResponse({"detail": detail}, status_code=status)


def bounded_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Pydantic errors without ``input``/``ctx``: the place and the rule, each part clipped."""
    return [
        {
            "type": str(error.get("type"))[:_MAX_CHARS],
            "loc": [part if isinstance(part, int) else str(part)[:40] for part in error["loc"]],
            "msg": str(error.get("msg"))[:_MAX_CHARS],
        }
        for error in errors[:_MAX_ERRORS]
        if isinstance(error, dict) and isinstance(error.get("loc"), Sequence)
    ]


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return refusal(request.method, request.url.path, bounded_errors(exc.errors()))


async def _http_error(request: Request, exc: Exception) -> Response:
    """OpenEnv's ``/step`` puts pydantic's errors, inputs included, in an HTTPException."""
    assert isinstance(exc, HTTPException)
    if not isinstance(exc.detail, list):
        return await http_exception_handler(request, exc)
    return refusal(request.method, request.url.path, bounded_errors(exc.detail), exc.status_code)


async def _invalid_reset(request: Request, exc: Exception) -> Response:
    return refusal(request.method, request.url.path, str(exc))
