"""How the dashboard is served: read-only, so Gradio's upload route is closed.

A public dashboard Space must not be a free file drop: Gradio 6 keeps `POST
/gradio_api/upload` open on every app (it writes what it is sent to the server's temp folder),
although no component of this dashboard takes a file. A pure-ASGI middleware answers 403 to it
before Gradio reads a byte of the body, and `max_file_size=0` stays as a second fence.
"""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

__all__ = ["RefuseUploads", "launch"]

log = logging.getLogger(__name__)


class RefuseUploads:
    """403 for any path ending in `/upload` (Gradio's upload route, under any root path)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].rstrip("/").endswith("/upload"):
            log.warning(
                "refused an upload to %.100s (this dashboard takes no files)", scope["path"]
            )
            body = b"this dashboard takes no uploads"
            headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def launch(demo: gr.Blocks, *, host: str, port: int, **options: Any) -> None:
    """`demo.launch` with uploads closed; the one way the app and its tests start it."""
    demo.launch(
        server_name=host,
        server_port=port,
        max_file_size=0,
        app_kwargs={"middleware": [Middleware(RefuseUploads)]},
        **options,
    )
