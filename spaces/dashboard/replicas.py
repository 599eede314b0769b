"""Replica status for the dashboard, read from each replica's own open `GET /health`.

Why there: a rollout server answers `/health` without its token, and its JSON body carries the
version it serves (verified) and its pause, so a public dashboard Space needs no credential at all
- neither the replicas' token nor a bucket token that could rewrite the manifest. The dashboard is
told which replicas to watch (`--replica URL`, or `DELTASYNC_REPLICAS`); the lag is the bucket's
latest version minus the served one. A replica that stops answering is shown as down, with the
time it last answered.

Once the run has committed nothing for `idle_after_s` (15 min), the replicas are no longer
polled: a request to a Space counts as activity, so an open dashboard tab would keep GPU replicas
from sleeping after training (or wake them). Their last status stays on the page, marked.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["ReplicaPoller", "ReplicaStatus", "parse_replica_urls"]

MAX_BODY = 64 * 1024
State = Literal["ok", "behind", "paused", "down"]


def parse_replica_urls(text: str | None) -> tuple[str, ...]:
    """`http(s)://host[:port]` URLs separated by commas or spaces; anything else is refused."""
    urls = tuple(u.rstrip("/") for u in (text or "").replace(",", " ").split())
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise ValueError(f"replica {url!r} is not an http(s)://host[:port] URL")
    return urls


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the dashboard last saw it."""

    url: str
    state: State
    version: int | None
    lag: int | None
    paused: bool
    last_pause_s: float | None
    seen_s_ago: float | None  # None: never answered
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Seen:
    body: dict[str, Any] | None = None
    at: float | None = None
    error: str = ""


class ReplicaPoller:
    """Polls every replica's `/health` in parallel, at most once per `min_poll_s`, and only
    while the run is live (a commit within `idle_after_s`, or no run yet)."""

    def __init__(
        self,
        urls: tuple[str, ...],
        *,
        timeout_s: float = 2.0,
        min_poll_s: float = 2.0,
        idle_after_s: float = 900.0,
    ):
        self.urls, self.timeout_s, self.min_poll_s = urls, timeout_s, min_poll_s
        self.idle_after_s = idle_after_s
        self._seen = {url: _Seen() for url in urls}
        self._polled = float("-inf")
        self._pool = ThreadPoolExecutor(max(1, min(8, len(urls))), thread_name_prefix="replica")

    def statuses(self, latest: int | None, idle_s: float | None = None) -> list[ReplicaStatus]:
        """Every replica's status; `latest` is the bucket's latest version (for the lag),
        `idle_s` the seconds since its last commit (None: no run yet)."""
        idle = idle_s is not None and idle_s >= self.idle_after_s
        if self.urls and not idle and time.monotonic() - self._polled >= self.min_poll_s:
            self._polled = time.monotonic()
            for url, (body, error) in zip(
                self.urls, self._pool.map(self._health, self.urls), strict=True
            ):
                seen = self._seen[url]
                if body is None:
                    seen.error = error
                else:
                    seen.body, seen.at, seen.error = body, time.monotonic(), ""
        statuses = [self._status(url, self._seen[url], latest) for url in self.urls]
        if not idle:
            return statuses
        why = (
            f"not polled: the run has committed nothing for {idle_s / 60:.0f} min "
            "(a request would keep a sleeping Space awake)"
        )
        return [
            replace(s, detail=f"{why}; last seen: {s.detail}" if s.detail else why)
            for s in statuses
        ]

    def _health(self, url: str) -> tuple[dict[str, Any] | None, str]:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=self.timeout_s) as answer:
                body = json.loads(answer.read(MAX_BODY + 1)[:MAX_BODY])
        except urllib.error.HTTPError as exc:
            return None, f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return None, type(exc).__name__
        return (body, "") if isinstance(body, dict) else (None, "not a JSON object")

    @staticmethod
    def _status(url: str, seen: _Seen, latest: int | None) -> ReplicaStatus:
        body = seen.body or {}
        version = body.get("version") if isinstance(body.get("version"), int) else None
        lag = None if version is None or latest is None else max(0, latest - version)
        pause = body.get("last_pause_s")
        ago = None if seen.at is None else time.monotonic() - seen.at
        if seen.error:
            state: State = "down"
            when = "never answered" if ago is None else f"last answered {ago:.0f} s ago"
            detail = f"no answer ({seen.error}); {when}"
        elif body.get("paused"):
            state, detail = "paused", f"paused while syncing {body.get('syncing_version')}"
        elif lag:
            state, detail = "behind", f"{lag} version(s) behind the bucket"
        else:
            state, detail = "ok", "serving the latest version" if version is not None else ""
        return ReplicaStatus(
            url,
            state,
            version,
            lag,
            bool(body.get("paused")),
            pause if isinstance(pause, (int, float)) else None,
            ago,
            detail,
        )
