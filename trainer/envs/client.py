"""OpenEnv's generic client, closing sessions cleanly and sending an API key when wanted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import urlsplit

from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect as ws_connect

__all__ = ["ClosingEnvClient", "KeyedEnvClient", "env_client"]


class ClosingEnvClient(GenericEnvClient):
    """`GenericEnvClient` that lets the server close the socket first.

    OpenEnv's own `disconnect` sends its close frame right after the `close` message; an
    openenv-core 0.3.0 server then closes a socket that is already gone, and uvicorn logs an
    `Exception in ASGI application` traceback for every session. Waiting (briefly) for the
    server's close frame ends each session with none.
    """

    close_timeout_s = 5.0

    async def disconnect(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(
            Exception
        ):  # best effort, as OpenEnv's own: the server may be gone
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), self.close_timeout_s)
        with contextlib.suppress(Exception):
            await ws.close()


class KeyedEnvClient(ClosingEnvClient):
    """A client whose WebSocket handshake carries `Authorization: Bearer <key>`.

    openenv-core 0.3.0's `EnvClient.connect` takes no headers; the Wordle Space (and any server
    behind the same rule) refuses `/ws` without the key when `ENV_API_KEY` is set there.
    """

    def __init__(self, base_url: str, api_key: str, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._api_key = api_key

    async def connect(self) -> KeyedEnvClient:
        if self._ws is None:
            loopback = urlsplit(self._ws_url).hostname in ("127.0.0.1", "localhost", "::1")
            try:
                self._ws = await ws_connect(
                    self._ws_url,
                    open_timeout=self._connect_timeout,
                    max_size=self._max_message_size,
                    additional_headers={"Authorization": f"Bearer {self._api_key}"},
                    **({"proxy": None} if loopback else {}),
                )
            except Exception as exc:  # OpenEnv's own contract: any failure is a ConnectionError
                raise ConnectionError(f"Failed to connect to {self._ws_url}: {exc}") from exc
        return self


def env_client(base_url: str, api_key: str | None = None, **kwargs: Any) -> ClosingEnvClient:
    """An async client of the server at `base_url`, sending `api_key` when there is one."""
    if api_key:
        return KeyedEnvClient(base_url, api_key, **kwargs)
    return ClosingEnvClient(base_url=base_url, **kwargs)
