"""A loopback sidecar that lets TRL, and only TRL's calls, reach token-protected rollout servers.

TRL's rollout worker and `VLLMClient` send no credentials, while our rollout servers require a
bearer token on every route; and TRL talks to one base URL, while the trainer drives several
replicas. The trainer points TRL at this proxy, which spreads TRL's requests over the replicas
(`trainer.routing.Router`: generation only to those within TRL's staleness, failing ones skipped
for a cool-down) and adds `Authorization: Bearer <token>`. Anything that can reach 127.0.0.1 can
reach the proxy, so it must not become a token-adding relay for the control routes (`/pause`,
`/collective_rpc`, weight updates): it forwards only the routes TRL's async GRPO calls, and only
for callers that know a per-process secret that TRL carries as the first path segment of its
base URL (TRL builds every URL as `f"{base_url}{route}"`, so the prefix survives). It also refuses
a foreign `Host` (DNS rebinding), any `Origin` (TRL sends none; browsers do) and POST bodies that
are not JSON (a cross-site form cannot send `application/json` without a CORS preflight, which is
refused). These checks run before a replica is chosen, the same for every replica.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
from collections.abc import Sequence
from typing import Final

import aiohttp
from aiohttp import web
from yarl import URL

from .routing import Eligible, Liveness, NoReplica, Router, completions_line

__all__ = ["ALLOWED_ROUTES", "AuthProxy"]

log = logging.getLogger(__name__)

# (method, route) pairs forwarded; where TRL 1.16 calls each (trl/experimental/async_grpo/):
ALLOWED_ROUTES: Final[frozenset[tuple[str, str]]] = frozenset(
    {
        ("POST", "/v1/completions"),  # async_rollout_worker.py, _generate_one_turn -> _post
        ("GET", "/v1/models"),  # vllm_client.py, get_max_model_len (token_budget=None)
        ("GET", "/server_info"),  # vllm_client.py, get_dtype / get_server_info
        ("GET", "/health"),  # vllm_client.py, wait_for_server_ready
    }
)
_KEEP_RESPONSE_HEADERS = {"content-type", "cache-control", "retry-after"}
_RETRYABLE_4XX = {408, 429}  # every other 4xx to a generation request is final
_PROBE_TIMEOUT_S = 5.0


class _OneLine(logging.Filter):
    """aiohttp's "Error handling request" for a request it cannot parse, as one warning line.

    aiohttp logs each with a traceback, so any local process could flood the trainer's log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:  # aiohttp's first line after the status, never the request itself
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = lines[min(1, len(lines) - 1)].rstrip(":")[:200] if lines else ""
            record.msg = f"auth proxy refused a malformed request: {type(error).__name__}: {reason}"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


# The proxy's HTTP server logs through this (aiohttp's `aiohttp.server` otherwise).
_http_log = logging.getLogger(f"{__name__}.http")
_http_log.addFilter(_OneLine())


class AuthProxy:
    """Forward TRL's routes from `url` (`http://127.0.0.1:<port>/<secret>`) to the `upstreams`.

    A context manager: entering starts the proxy on its own thread and event loop and sets `url`,
    the base URL to hand to TRL. `url` holds the secret, so log `display_url` instead.
    TRL's generation calls are plain JSON request/response (never `stream`), so bodies are
    buffered whole. A request whose connection a replica refuses goes to the next one; one that
    no replica can take is answered 503 with a one-line reason (TRL's rollout worker retries).
    When rollouts cannot go on - every replica down for `dead_after_s` (`routing.Liveness`, fed
    by a `/health` probe every 2 s), or a generation request refused for good (a final 4xx) -
    `stop_reason` says why and generation gets an answer TRL does not retry.
    On exit it logs the completions each replica answered (`router.completions()`).

    Args:
        upstreams: the rollout servers' base URLs.
        token: their bearer token; None: they take none (nothing is added).
        eligible: which upstreams may generate now (`trainer.routing.Eligible`); None: all.
        cooldown_s: how long a replica that refused a connection or answered 5xx is skipped.
        stall_s: the least time a generation waits at a replica that answers none before it
            goes to another replica that answers, and that replica sits out `cooldown_s`
            (`Router.stalled`: the wait also grows with the generations' length).
        timeout_s: per forwarded request.
        dead_after_s: how long every replica's `/health` must fail before rollouts stop;
            None: no probes, replicas are never declared down.
        probe_s: seconds between two rounds of `/health` probes.
    """

    def __init__(
        self,
        upstreams: Sequence[str],
        token: str | None,
        *,
        eligible: Eligible | None = None,
        cooldown_s: float = 5.0,
        stall_s: float = 10.0,
        timeout_s: float = 600.0,
        dead_after_s: float | None = 10.0,
        probe_s: float = 2.0,
    ):
        self.router = Router(upstreams, eligible, cooldown_s=cooldown_s, stall_s=stall_s)
        self._check_s = min(1.0, stall_s / 4)
        self.liveness = None if dead_after_s is None else Liveness(upstreams, dead_after_s)
        self.stop_reason: str | None = None  # set once, on the proxy's loop; read by the trainer
        self._probe_s = probe_s
        self._token = token
        self._secret = secrets.token_urlsafe(24)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._host = ""  # the only Host header accepted, "127.0.0.1:<port>", set on start
        self._session: aiohttp.ClientSession | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="auth-proxy", daemon=True)
        self.url = ""

    @property
    def display_url(self) -> str:
        """`url` with the secret cut to its first 4 characters, for logs."""
        return f"http://{self._host}/{self._secret[:4]}…"

    def __enter__(self) -> AuthProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("auth proxy did not start within 30 s")
        log.info("auth proxy %s -> %s", self.display_url, self.router.upstreams)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        log.info("%s", completions_line(self.router.completions()))  # the launcher reads it

    def _admit(self, request: web.Request) -> str | web.Response:
        """The route to forward, or the refusal; checks run before any byte is read or sent."""
        first, _, rest = request.rel_url.raw_path[1:].partition("/")
        if not hmac.compare_digest(first.encode(errors="replace"), self._secret.encode()):
            # No path is logged: a near miss could be most of the secret.
            return self._refuse(request.method, "<no secret prefix>", 404, "not found")
        route = f"/{rest}"
        if request.headers.get("Host") != self._host:
            return self._refuse(request.method, route, 403, "Host is not the proxy's address")
        if "Origin" in request.headers:
            return self._refuse(request.method, route, 403, "requests with an Origin are refused")
        if (request.method, route) not in ALLOWED_ROUTES:
            return self._refuse(request.method, route, 403, "route is not forwarded")
        if request.method == "POST" and request.content_type != "application/json":
            return self._refuse(request.method, route, 415, "POST body must be application/json")
        return route

    @staticmethod
    def _refuse(method: str, route: str, status: int, reason: str) -> web.Response:
        log.warning("auth proxy refused %.10s %.100r: %s (%d)", method, route, reason, status)
        return web.Response(status=status, text=reason)

    async def _forward(self, request: web.Request) -> web.Response:
        admitted = self._admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        # nothing else of the caller's is passed on
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        body = None
        if request.method == "POST":
            headers["Content-Type"] = request.headers["Content-Type"]
            body = await request.read()
        generation = admitted == "/v1/completions"
        if generation and self.stop_reason is not None:
            return self._stopped()
        tried: dict[str, str] = {}  # upstream -> why it could not take this request
        while True:  # at most once per upstream: each pass adds one to `tried`
            url = self.router.pick(generation=generation, tried=tried)
            if isinstance(url, NoReplica):
                return self._unavailable(url, tried)
            target = URL(url + admitted).with_query(request.rel_url.query)
            try:
                return await self._send(url, request.method, target, headers, body, generation)
            except aiohttp.ClientConnectorError as exc:  # nothing reached it: try another
                tried[url] = repr(exc)
            except _Stalled as exc:  # never answered: another replica generates it
                tried[url] = str(exc)

    async def _send(
        self,
        url: str,
        method: str,
        target: URL,
        headers: dict[str, str],
        body: bytes | None,
        generation: bool,
    ) -> web.Response:
        """One attempt at one upstream; its outcome goes to the router whatever happens."""
        assert self._session is not None  # set before the site starts
        failure, status, done = None, 0, False
        since = self.router.started(url)
        exchange = asyncio.ensure_future(self._exchange(method, target, headers, body))
        try:
            while not exchange.done():
                await asyncio.wait({exchange}, timeout=self._check_s)
                if not exchange.done() and generation and (why := self.router.stalled(url, since)):
                    exchange.cancel()  # vLLM aborts a request whose client went away
                    failure, done = why, True
                    raise _Stalled(why)
            upstream, reply = exchange.result()
            status, done = upstream.status, True
            if status >= 500:
                failure = f"answered {status}"
            elif generation and 400 <= status < 500 and status not in _RETRYABLE_4XX:
                self._stop(_refusal(url, status, reply))
                return self._stopped()
            keep = {
                k: v for k, v in upstream.headers.items() if k.lower() in _KEEP_RESPONSE_HEADERS
            }
            return web.Response(status=status, body=reply, headers=keep)
        except aiohttp.ClientConnectorError:
            failure, done = "refused the connection", True
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            # A replica that died mid-request: answer 502 (TRL's rollout worker retries it)
            # instead of letting aiohttp log a traceback for every request.
            failure, done = f"failed a request ({type(exc).__name__})", True
            return web.Response(status=502, text=f"rollout server {url} unreachable: {exc!r}")
        finally:  # not done: the caller went away (cancelled), which says nothing of the replica
            exchange.cancel()  # a no-op once it is done
            self.router.finished(
                url,
                failure=failure,
                generated=generation and 200 <= status < 300,
                cancelled=not done,
                since=since,
            )

    async def _exchange(
        self, method: str, target: URL, headers: dict[str, str], body: bytes | None
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        assert self._session is not None  # set before the site starts
        async with self._session.request(
            method, target, headers=headers, data=body, timeout=self._timeout
        ) as upstream:
            return upstream, await upstream.read()

    def _stop(self, reason: str) -> None:
        """Rollouts cannot go on: keep the first reason, log it once."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.error("rollouts stopped: %s", reason)

    def _stopped(self) -> web.Response:
        """The answer TRL's rollout worker does not retry: a 2xx that is not a completion."""
        error = {"message": self.stop_reason, "type": "RolloutsStopped"}
        return web.json_response({"error": error}, status=200)

    async def _watch(self, liveness: Liveness) -> None:
        """Probe every replica's `/health` each `probe_s`; once all are down, stop rollouts."""
        urls = self.router.upstreams
        while self.stop_reason is None:
            failures = await asyncio.gather(*(self._probe(url) for url in urls))
            for url, failure in zip(urls, failures, strict=True):
                liveness.probed(url, failure)
            down = liveness.down()
            if len(down) == len(urls):
                self._stop(_all_down(down))
                return
            await asyncio.sleep(self._probe_s)

    async def _probe(self, url: str) -> str | None:
        """How `url`'s `/health` failed (one line), None if it answered 200."""
        assert self._session is not None  # set before the watch starts
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
        try:
            async with self._session.get(url + "/health", headers=headers, timeout=timeout) as r:
                await r.read()
        except aiohttp.ClientConnectorError:
            return "could not be reached"
        except TimeoutError:
            return f"did not answer in {_PROBE_TIMEOUT_S:.0f} s"
        except aiohttp.ClientError as exc:
            return f"failed ({type(exc).__name__})"
        return None if r.status == 200 else f"answered {r.status}"

    @staticmethod
    def _unavailable(refusal: NoReplica, tried: dict[str, str]) -> web.Response:
        """502 when the replicas tried all refused the connection, else 503: none could take it."""
        if tried:
            url, error = next(reversed(tried.items()))
            return web.Response(status=502, text=f"rollout server {url} unreachable: {error}")
        log.debug("auth proxy: %s", refusal.reason)
        return web.Response(status=503, text=refusal.reason, headers={"Retry-After": "1"})

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> web.AppRunner:
            self._session = aiohttp.ClientSession()
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._forward)
            runner = web.AppRunner(app, access_log=None, logger=_http_log)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._host = f"127.0.0.1:{port}"
            self.url = f"http://{self._host}/{self._secret}"
            return runner

        runner = self._loop.run_until_complete(start())
        watch = None
        if self.liveness is not None:
            watch = self._loop.create_task(self._watch(self.liveness))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            if watch is not None:
                watch.cancel()
                self._loop.run_until_complete(asyncio.gather(watch, return_exceptions=True))
            self._loop.run_until_complete(runner.cleanup())
            if self._session is not None:
                self._loop.run_until_complete(self._session.close())
            self._loop.close()


class _Stalled(Exception):
    """A generation request given up at a stalled replica (`Router.stalled`), to be sent on."""


def _refusal(url: str, status: int, reply: bytes) -> str:
    """One line for a generation request a replica refused for good (vLLM's error message)."""
    try:
        error = json.loads(reply)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = reply.decode(errors="replace"), None
    message = " ".join(message.split())[:400]
    if param == "input_tokens":  # vLLM: the prompt alone is longer than the context
        return (
            f"a rollout's prompt does not fit the context of rollout server {url}: {message} "
            "Raise the replicas' --max-model-len (launch.py --vllm-args) or shorten rollouts "
            "(trainer --max-tool-calls, --max-completion-length)"
        )
    return f"rollout server {url} refused a generation request (HTTP {status}): {message}"


def _all_down(down: dict[str, str]) -> str:
    """One line naming every replica and why it is down."""
    if len(down) == 1:
        [(url, reason)] = down.items()
        return f"rollout replica {url} is down: {reason}"
    return "every rollout replica is down: " + "; ".join(f"{u} {r}" for u, r in down.items())
