"""Bearer-token authentication for every route of a rollout server, plus a bootstrap gate.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere (0.32,
`entrypoints/serve/middleware/authenticate.py`): the dev-mode control routes (/pause,
/update_weights, /collective_rpc, /sleep, /scale_elastic_ep, ...), /invocations (which generates),
/tokenize and /metrics stay open. This pure-ASGI middleware denies by default: every HTTP or
websocket request except `GET /health` needs `Authorization: Bearer <token>` (constant-time
compare), otherwise 401 before the app sees it.

vLLM adds it with `--middleware deltasync.vllm_ext.auth.BearerAuthMiddleware` and passes no
arguments, so it reads its settings from the environment the launcher prepared:
DELTASYNC_API_KEY (required) and DELTASYNC_GATE=1, which answers 503 to everything but the
control routes until the server has recorded a weight version (so a replica started against a
bucket never serves the checkpoint it booted with).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

__all__ = ["CONTROL_PATHS", "OPEN_PATHS", "TOKEN_ENV", "BearerAuthMiddleware"]

TOKEN_ENV = "DELTASYNC_API_KEY"
GATE_ENV = "DELTASYNC_GATE"
OPEN_PATHS = frozenset({"/health"})
# Reachable (with the token) before the first weight version is recorded: control routes and
# metadata that serves no weights (TRL asks /v1/models for max_model_len before its first sync).
CONTROL_PATHS = frozenset(
    {
        "/health",
        "/weight_info",
        "/is_paused",
        "/pause",
        "/resume",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/get_world_size",
        "/server_info",
        "/version",
        "/metrics",
        "/v1/models",
    }
)
_UNSET_VERSION = "default"  # what vLLM reports before any finish_weight_update(weight_version)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerAuthMiddleware:
    """Deny-by-default bearer authentication (and the optional bootstrap gate).

    Args:
        app: the wrapped ASGI app.
        token: the accepted token; defaults to the DELTASYNC_API_KEY environment variable.
        gate: hold non-control routes until a weight version is recorded; defaults to
            DELTASYNC_GATE=1.
    """

    def __init__(self, app: Any, token: str | None = None, gate: bool | None = None):
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        if not token:
            raise RuntimeError(
                f"{TOKEN_ENV} is empty: set it (e.g. a Space secret) or start the server "
                "without this middleware on a loopback address"
            )
        self.app = app
        self._expected = _digest(token)
        self.gate = os.environ.get(GATE_ENV) == "1" if gate is None else gate
        self._serving = not self.gate

    def _authorized(self, scope: dict[str, Any]) -> bool:
        value = b""
        for key, header in scope.get("headers", ()):
            if key.lower() == b"authorization":
                value = header
                break
        scheme, _, token = value.decode("latin-1").partition(" ")
        # Hash both sides so the comparison takes the same time whatever the token's length.
        matches = hmac.compare_digest(_digest(token.strip()), self._expected)
        return scheme.lower() == "bearer" and matches

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        is_open = path in OPEN_PATHS and scope.get("method") in ("GET", "HEAD")
        if not is_open and not self._authorized(scope):
            return await _deny(kind, receive, send, 401, "missing or wrong bearer token")
        gated = not self._serving and path not in CONTROL_PATHS
        if gated and not await self._has_version(scope):
            message = "bootstrapping: no weight version is served yet"
            return await _deny(kind, receive, send, 503, message)
        return await self.app(scope, receive, send)

    async def _has_version(self, scope: dict[str, Any]) -> bool:
        """True once the engine reports a recorded weight version (then cached for good)."""
        app = scope.get("app")
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if engine is None:
            return False
        version = await engine.get_weight_version()
        self._serving = version != _UNSET_VERSION
        return self._serving


async def _deny(kind: str, receive: Any, send: Any, status: int, message: str) -> None:
    if kind == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008 if status == 401 else 1013})
        return
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deltasync"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
