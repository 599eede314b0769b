"""A rollout server's ASGI layer around vLLM's app: authentication, the route policy, the
control routes, a bootstrap gate and `/health`, assembled from the environment.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere (0.32,
`entrypoints/serve/middleware/authenticate.py`), and its dev-mode routes (/pause, /update_weights,
/collective_rpc, /sleep, ...) let a caller pause the server forever, set any weight version or run
any worker method. This pure-ASGI middleware, in order:

1. authenticates (`auth`): every HTTP or websocket request except `GET`/`HEAD /health` needs
   `Authorization: Bearer <token>`, otherwise 401;
2. allows only the routes in `ROUTES` (exact method and path): generation, read-only info, and
   the control routes `control.ControlPlane` serves in process (the sync route, whitelisted
   `deltasync_*` RPCs, the bucket init); everything else is 403, so the sync route is the only
   way to change weights or versions;
3. bounds request bodies (413);
4. with the gate on, answers 503 to generation until a weight version is recorded (a replica
   started against a bucket never serves the checkpoint it booted with).

`GET /health` answers vLLM's status with a JSON body that reports a pause (200 while paused)
and, when the server follows its bucket, the follower's state.

vLLM adds it with `--middleware deltasync.vllm_ext.server.app.BearerAuthMiddleware` and passes no
arguments, so it reads what it is not given from the environment the serve parent prepared
(`deltasync.settings`): the token, the gate, the pause deadline, vLLM's dev routes for loopback
clients, and whether to run a `follow.Follower` (started with the server's event loop, stopped
at its shutdown) and how often it polls. `LoopbackMiddleware` is the same policy without a
token, for loopback clients that are not web pages (`serve --insecure-no-auth`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from deltasync import settings
from deltasync.vllm_ext.protocol import SYNC_PATH
from deltasync.vllm_ext.server.auth import Credentials, browser_problem, is_loopback
from deltasync.vllm_ext.server.control import (
    RPC_METHODS,
    ControlConfig,
    ControlError,
    ControlPlane,
)
from deltasync.vllm_ext.server.follow import FollowConfig, Follower

__all__ = ["ROUTES", "BearerAuthMiddleware", "LoopbackMiddleware"]

OPEN, CONTROL, INFO, SERVE = "open", "control", "info", "serve"
# (method, path) -> kind. OPEN needs no token; CONTROL is served by `ControlPlane`; INFO is
# read-only and, like CONTROL, reachable before the first version; SERVE waits for it (the gate).
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/health"): OPEN,
    ("HEAD", "/health"): OPEN,
    ("POST", SYNC_PATH): CONTROL,
    ("POST", "/collective_rpc"): CONTROL,
    ("POST", "/init_weight_transfer_engine"): CONTROL,
    ("GET", "/weight_info"): INFO,
    ("GET", "/is_paused"): INFO,
    ("GET", "/server_info"): INFO,  # TRL's get_dtype
    ("GET", "/version"): INFO,
    ("GET", "/get_world_size"): INFO,
    ("GET", "/load"): INFO,
    ("GET", "/metrics"): INFO,
    ("GET", "/openapi.json"): INFO,
    ("GET", "/v1/models"): INFO,  # TRL asks for max_model_len before its first sync
    ("POST", "/v1/completions"): SERVE,
    ("POST", "/v1/chat/completions"): SERVE,
    ("POST", "/tokenize"): SERVE,
    ("POST", "/detokenize"): SERVE,
}
CONTROL_BODY_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024  # prompts; vLLM sets no limit of its own
_UNSET_VERSION = "default"  # what vLLM reports before any version is recorded
log = logging.getLogger("deltasync.auth")


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class BearerAuthMiddleware:
    """Deny-by-default authentication and route policy, and the control routes.

    Args:
        app: the wrapped ASGI app.
        token: the accepted token (default: `settings.API_KEY`).
        gate: hold generation until a weight version is recorded (default: `settings.GATE`).
        control: the control plane (default: `control_from_settings()`). Its `follower` is
            started with the first event that reaches the engine (the server's lifespan
            start-up).
        insecure: accept loopback clients without a token (`LoopbackMiddleware`).
        dev_routes: let loopback clients reach vLLM's other routes (default:
            `settings.DEV_ROUTES`).

    Raises:
        settings.SettingError: a variable it reads is malformed (vLLM does not start).
    """

    def __init__(
        self,
        app: Any,
        token: str | None = None,
        gate: bool | None = None,
        *,
        control: ControlPlane | None = None,
        insecure: bool = False,
        dev_routes: bool | None = None,
    ):
        token = ("" if insecure else settings.API_KEY.read()) if token is None else token
        if not token and not insecure:
            raise RuntimeError(
                f"{settings.API_KEY.name} is empty: set it (e.g. a Space secret) or start the "
                "server with LoopbackMiddleware (serve --insecure-no-auth) on a loopback address"
            )
        self.app = app
        self.credentials = Credentials(token)
        self.gate = settings.GATE.read() if gate is None else gate
        self._serving = not self.gate
        self.dev_routes = settings.DEV_ROUTES.read() if dev_routes is None else dev_routes
        self.control = control_from_settings() if control is None else control
        _log_to_stderr()
        if self.dev_routes:
            log.warning("%s=1: vLLM's dev routes answer loopback clients", settings.DEV_ROUTES.name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        follower = self.control.follower
        if follower is not None and not follower.started and _engine(scope) is not None:
            follower.start(_engine(scope))
        if kind == "lifespan" and follower is not None:
            return await self.app(scope, _stopping(follower, receive), send)
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method = scope.get("method", "GET") if kind == "http" else "WEBSOCKET"
        path = scope.get("path", "")
        route = ROUTES.get((method, path))
        try:
            if route != OPEN and not self.credentials.authorized(scope):
                raise _Refused(401, "missing or wrong bearer token")
            if self.credentials.tokenless and (problem := browser_problem(scope, method)):
                log.warning("deltasync: refused %s %s: %s", method, _one_line(path, 200), problem)
                raise _Refused(403, problem)
            if route is None:
                if not (self.dev_routes and is_loopback(scope)):
                    shown = _one_line(path, 200)
                    log.warning("deltasync: refused %s %s (not a route)", method, shown)
                    raise _Refused(403, f"{method} {shown} is not a route of this server")
                route = SERVE
            body = b""
            if kind == "http" and method not in ("GET", "HEAD"):
                limit = CONTROL_BODY_BYTES if route == CONTROL else MAX_BODY_BYTES
                body = await _read_body(scope, receive, limit)
            if route == SERVE and not self._serving and not await self._has_version(scope):
                raise _Refused(503, "bootstrapping: no weight version is served yet")
        except _Refused as refused:
            return await _deny(kind, receive, send, refused.status, str(refused))
        if route == OPEN:
            return await self._health(scope, receive, send)
        if route == CONTROL and not self._dev_rpc(scope, path, body):
            return await self._control(scope, path, body, send)
        return await self.app(scope, _replay(body, receive) if body else receive, send)

    def _dev_rpc(self, scope: dict[str, Any], path: str, body: bytes) -> bool:
        """With dev routes on: a loopback `/collective_rpc` of a method outside the whitelist,
        which then goes to vLLM's own route (a benchmark's `reload_weights`)."""
        if not (self.dev_routes and path == "/collective_rpc" and is_loopback(scope)):
            return False
        try:
            method = json.loads(body).get("method")
        except (ValueError, AttributeError, RecursionError):
            return False
        return isinstance(method, str) and method not in RPC_METHODS

    async def _has_version(self, scope: dict[str, Any]) -> bool:
        """True once the engine reports a recorded weight version (then cached for good)."""
        engine = _engine(scope)
        if engine is None:
            return False
        version = await engine.get_weight_version()
        self._serving = version != _UNSET_VERSION
        return self._serving

    async def _health(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """vLLM's health status, with the pause state as a JSON body."""
        status = 500

        async def capture(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await self.app(scope | {"method": "GET"}, receive, capture)
        body = {"status": "ok" if status == 200 else "unhealthy"} | self.control.health()
        await _answer(send, status, body, head=scope.get("method") == "HEAD")

    async def _control(self, scope: dict[str, Any], path: str, raw: bytes, send: Any) -> None:
        """A control route: one JSON answer; a refusal or failure is one log line."""
        handler = {
            SYNC_PATH: self.control.sync,
            "/collective_rpc": self.control.rpc,
            "/init_weight_transfer_engine": self.control.init,
        }[path]
        try:
            engine = _engine(scope)
            if engine is None:
                raise ControlError(503, "the engine is not up yet")
            try:
                body = json.loads(raw or b"null")
            except (ValueError, RecursionError):
                raise ControlError(400, "the body is not JSON") from None
            status, answer = 200, await handler(engine, body)
        except ControlError as exc:
            status, answer = exc.status, {"error": str(exc), **exc.fields}
            level = logging.WARNING if status < 500 else logging.ERROR
            log.log(level, "deltasync: POST %s answered %d: %s", path, status, _one_line(exc))
        except Exception as exc:  # a bug: still one JSON answer and one log line
            message = f"internal error: {type(exc).__name__}: {exc}"
            status, answer = 500, {"error": message}
            log.error("deltasync: POST %s failed: %s", path, _one_line(message))
        await _answer(send, status, answer)


def control_from_settings() -> ControlPlane:
    """The control plane the environment asks for: its pause deadline and, when the server
    follows its bucket, a follower polling at its interval."""
    deadline = settings.PAUSE_DEADLINE_S.read()
    try:
        control = ControlPlane(ControlConfig(pause_deadline_s=deadline))
    except ValueError as exc:
        raise settings.SettingError(f"{settings.PAUSE_DEADLINE_S.name}: {exc}") from None
    if settings.FOLLOW.read():
        interval = settings.FOLLOW_INTERVAL_S.read()
        try:
            control.follower = Follower(control, FollowConfig(interval_s=interval))
        except ValueError as exc:
            raise settings.SettingError(f"{settings.FOLLOW_INTERVAL_S.name}: {exc}") from None
    return control


class LoopbackMiddleware(BearerAuthMiddleware):
    """The same routes and control plane without a token: only loopback clients get in
    (`python -m deltasync.vllm_ext.serve --insecure-no-auth` on 127.0.0.1)."""

    def __init__(self, app: Any, **options: Any):
        super().__init__(app, token="", insecure=True, **options)


def _one_line(text: object, limit: int = 2000) -> str:
    """`text` on one log line (request-controlled strings may hold line breaks), cut short."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")[:limit]


def _engine(scope: dict[str, Any]) -> Any:
    """vLLM's engine client (`app.state.engine_client`), None before start-up completes."""
    return getattr(getattr(scope.get("app"), "state", None), "engine_client", None)


async def _read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes:
    """The whole request body, refused (413) past `limit` bytes before reading more."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length" and (not value.isdigit() or int(value) > limit):
            raise _Refused(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Refused(400, "the client went away before sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _stopping(follower: Follower, receive: Any) -> Any:
    """A lifespan `receive` that stops the follower when the server shuts down (before vLLM's
    lifespan drops the engine)."""

    async def received() -> dict[str, Any]:
        message = await receive()
        if message.get("type") == "lifespan.shutdown":
            await follower.stop()
        return message

    return received


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that hands the app the body already read, then the client's own messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


async def _answer(send: Any, status: int, body: Any, *, head: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deltasync"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else data})


async def _deny(kind: str, receive: Any, send: Any, status: int, message: str) -> None:
    if kind == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008 if status in (401, 403) else 1013})
        return
    await _answer(send, status, {"error": message})


def _log_to_stderr() -> None:
    """Make this package's log lines visible in vLLM's server log (vLLM configures only its own
    `vllm` logger); left alone when the process configured logging itself."""
    package = logging.getLogger("deltasync")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
