"""Who may call a rollout server: a bearer token compared in constant time or, on a server
started without one (`serve --insecure-no-auth`), loopback clients that are not web pages.

A web page on the same machine is a loopback client too, so without a token a request is also
refused when it carries what only a browser sends: a `Host` that is not a loopback literal (DNS
rebinding), any `Origin`, or a POST body that is not `application/json` (a CORS "simple request"
needs no preflight). What each route then allows is the app's (`app.ROUTES`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any

__all__ = ["Credentials", "browser_problem", "header", "is_loopback"]


def header(scope: dict[str, Any], name: bytes) -> str | None:
    """An ASGI request's header `name` (lower case), None when absent."""
    value = next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


def is_loopback(scope: dict[str, Any]) -> bool:
    """The client connected from a loopback address."""
    client = scope.get("client") or ("", 0)
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _loopback_host(host: str | None) -> bool:
    """`Host` names this machine by a loopback literal (any port: port-forwards keep working)."""
    if not host:
        return False
    # "[::1]:8001" -> "::1", "127.0.0.1:8001" -> "127.0.0.1"
    name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def browser_problem(scope: dict[str, Any], method: str) -> str | None:
    """Why a request without a token looks like a web page's, None when it does not."""
    if not _loopback_host(header(scope, b"host")):
        return "Host is not a loopback address (127.0.0.1, localhost, [::1])"
    if header(scope, b"origin") is not None:
        return "requests with an Origin are refused"
    content_type = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if method == "POST" and content_type != "application/json":
        return "POST body must be application/json"
    return None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Credentials:
    """What a caller must present: `Authorization: Bearer <token>`, or with no token (`""`),
    a loopback address."""

    def __init__(self, token: str):
        self._expected = _digest(token) if token else None

    @property
    def tokenless(self) -> bool:
        return self._expected is None

    def authorized(self, scope: dict[str, Any]) -> bool:
        if self._expected is None:
            return is_loopback(scope)
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        # Hash both sides so the comparison takes the same time whatever the token's length.
        matches = hmac.compare_digest(_digest(token.strip()), self._expected)
        return scheme.lower() == "bearer" and matches
