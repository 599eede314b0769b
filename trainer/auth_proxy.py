"""A loopback sidecar that adds the rollout server's bearer token to TRL's requests.

TRL's rollout worker and `VLLMClient` send no credentials, while our rollout servers require a
bearer token on every route (completions included). Instead of putting the token into a URL
(where logs would show it), the trainer points TRL at this proxy on 127.0.0.1, which forwards
each request to the real server with `Authorization: Bearer <token>` added.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
from aiohttp import web

__all__ = ["AuthProxy"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "authorization",
    "content-encoding",
}


class AuthProxy:
    """Forward `http://127.0.0.1:<port>/...` to `upstream` with a bearer token (one thread)."""

    def __init__(self, upstream: str, token: str, *, timeout_s: float = 600.0):
        self.upstream = upstream.rstrip("/")
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="auth-proxy", daemon=True)
        self.url = ""

    def __enter__(self) -> AuthProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("auth proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        session: aiohttp.ClientSession | None = None

        async def forward(request: web.Request) -> web.Response:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Authorization"] = f"Bearer {self._token}"
            try:
                async with session.request(
                    request.method,
                    self.upstream + request.rel_url.path_qs,
                    headers=headers,
                    data=await request.read(),
                    timeout=self._timeout,
                ) as upstream:
                    body = await upstream.read()
                    keep = {
                        k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
                    }
                    return web.Response(status=upstream.status, body=body, headers=keep)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # A replica that is down or restarting: answer 502 (TRL's rollout worker retries
                # it) instead of letting aiohttp log a traceback for every request.
                return web.Response(
                    status=502, text=f"rollout server {self.upstream} unreachable: {exc!r}"
                )

        async def start() -> web.AppRunner:
            nonlocal session
            session = aiohttp.ClientSession()
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            return runner

        runner = self._loop.run_until_complete(start())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.run_until_complete(session.close())
            self._loop.close()
