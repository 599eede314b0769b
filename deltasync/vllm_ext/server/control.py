"""The control plane of a rollout server, run inside vLLM's API server process.

`POST /deltasync/sync {"version": 7, "path": "runs/..."}` is the one request that changes a
replica's weights or version: it stages the version while the model serves, pauses generation,
applies and verifies it, records the version the workers verified as vLLM's `weight_version`,
clears the prefix cache and resumes, and answers what it did. Beside it: the read-only and staging
`deltasync_*` RPCs (`POST /collective_rpc`, a whitelist) and the bucket init
(`POST /init_weight_transfer_engine`, which never re-points a bootstrapped replica).

vLLM 0.32 lets a deployment run its own code in the API server only as ASGI middleware
(`--middleware`; an endpoint plugin needs an installed entry point and a `VLLM_PLUGINS`
allowlist), so the auth middleware (`auth.BearerAuthMiddleware`) hands these requests here, and
this module calls vLLM's engine client (`app.state.engine_client`, an `AsyncLLM`) in process:
`pause_generation`, `collective_rpc`, `update_weight_version`, `reset_prefix_cache`,
`resume_generation`. Nothing crosses HTTP inside the pause.

A pause ends by itself: a watchdog resumes generation once `pause_deadline_s` has passed (one log
line); a sync whose deadline passed before its apply began gives up without applying (503).

A server started with `serve --follow` also runs a `follow.Follower` here, which syncs through
`sync_version` like the route does: one lock, one apply path, one pause (its staging plans from
the manifest bytes the poll read, which the workers do not read again). A sync to the version
the workers already hold (of the bucket's run, with the bucket's digest) is a no-op success, so a
trainer's push that arrives after the follower applied its version changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deltasync import defaults
from deltasync.errors import DeltaSyncError, FormatError
from deltasync.store import RetryPolicy, Store, open_store
from deltasync.vllm_ext.protocol import (
    SYNC_PATH,
    InitInfo,
    SyncRequest,
    merge_statuses,
    parse_message,
    stage_args,
)
from deltasync.wire.manifest import read_manifest

__all__ = ["RPC_METHODS", "ControlConfig", "ControlError", "ControlPlane"]

log = logging.getLogger("deltasync.control")

STAGE_RPC = "deltasync_stage"
SHARE_RPC = "deltasync_state_share"  # its `start` begins a background pass, changing nothing
# What `/collective_rpc` may run: staging (it changes nothing served) and read-only inspection.
RPC_METHODS = frozenset(
    {STAGE_RPC, "deltasync_status", "deltasync_digests", "deltasync_engine_digests", SHARE_RPC}
)
# HTTP status of a refusal by its error type: the replica cannot take that version as it stands
# (409), or the bucket failed (502); anything else is the server's fault (500).
_DEATH_POLL_S = 0.5  # how often a call in flight checks that the engine still lives
_STATUS_OF = {"FormatError": 409, "ChainError": 409, "DigestMismatch": 409, "StoreError": 502}
NOOP_READ_TIMEOUT_S = 30.0  # the manifest read that tells a no-op sync; then a full sync decides


class ControlError(Exception):
    """A control request refused or failed: its HTTP status, message and extra JSON fields."""

    def __init__(self, status: int, message: str, **fields: Any):
        super().__init__(message)
        self.status = status
        self.fields = fields


@dataclass(frozen=True)
class ControlConfig:
    """Settings of the control plane (the server app builds it from the environment).

    Attributes:
        pause_deadline_s: longest time generation stays paused; then it resumes by itself.
        stage_timeout_s: longest wait for a version's staging before giving up (not paused).
        busy_timeout_s: longest wait for another sync (or init) to finish.
        poll_s: interval of the staging status polls (in process, not HTTP).
    """

    pause_deadline_s: float = defaults.PAUSE_DEADLINE_S
    stage_timeout_s: float = defaults.STAGE_TIMEOUT_S
    busy_timeout_s: float = defaults.STAGE_TIMEOUT_S
    poll_s: float = 0.02

    def __post_init__(self) -> None:
        for name in ("pause_deadline_s", "stage_timeout_s", "busy_timeout_s", "poll_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise ValueError(f"{name} must be a number of seconds in (0, 86400], got {value!r}")


@dataclass
class _Pause:
    version: int
    started: float
    ended: float | None = None
    expired: bool = False
    watchdog: asyncio.Task | None = field(default=None, repr=False)


class ControlPlane:
    """Handlers of the control routes; one per API server process (its lock serialises syncs).

    Each handler takes vLLM's engine client and the decoded JSON body, and returns the JSON
    answer or raises `ControlError`.
    """

    def __init__(self, config: ControlConfig | None = None):
        self.config = config or ControlConfig()
        self._lock = asyncio.Lock()
        self.pause: _Pause | None = None
        self.pauses_expired = 0
        # A `follow.Follower` when the server follows its bucket (the middleware sets it); its
        # state joins /health and `deltasync_status`.
        self.follower: Any = None
        self._stores: dict[str, Store] = {}
        self.served: tuple[int, float] | None = None  # the last synced version and its pause

    def health(self) -> dict[str, Any]:
        """The pause and follow state `/health` reports (it answers 200 while paused), with the
        version served since the last sync (verified) and that sync's pause: what a public
        dashboard shows without holding any token."""
        pause = self.pause
        version, last_pause_s = self.served or (None, None)
        body: dict[str, Any] = {
            "version": version,
            "last_pause_s": last_pause_s,
            "paused": pause is not None,
            "pause_deadline_s": self.config.pause_deadline_s,
            "pauses_expired": self.pauses_expired,
            "following": self.follower is not None,
        }
        if pause is not None:
            body["paused_for_s"] = round(time.monotonic() - pause.started, 3)
            body["syncing_version"] = pause.version
        if self.follower is not None:
            body["follow"] = self.follower.state(public=True)
        return body

    def store(self, url: str) -> Store:
        """The bucket as this process reads it (the manifest only): one attempt per call, since
        its callers own their retries (the follower backs off; a no-op check falls back to a
        full sync)."""
        if url not in self._stores:
            self._stores[url] = open_store(url, retry=RetryPolicy(attempts=1))
        return self._stores[url]

    # -- the sync route --------------------------------------------------------------------------

    async def sync(self, engine: Any, body: Any) -> dict[str, Any]:
        """Stage, pause, apply, verify, record, clear the prefix cache, resume."""
        return await self.sync_version(engine, _parse(SyncRequest, body, "sync request"))

    async def sync_version(
        self, engine: Any, request: SyncRequest, *, by: str = "push", manifest: bytes | None = None
    ) -> dict[str, Any]:
        """The sync route's work, for the route (`by` "push") and the follower ("follow"):
        under the one lock, so two syncs never interleave. `manifest`: the bytes the follower's
        poll read, which the workers stage from instead of reading the manifest again (never
        from a request: the route has no such field)."""
        async with self._held():
            answer = await self._sync(engine, request, by, manifest)
            if isinstance(answer.get("version"), int):
                self.served = (answer["version"], answer["pause_s"])
            return answer

    async def _sync(
        self, engine: Any, request: SyncRequest, by: str, manifest: bytes | None
    ) -> dict[str, Any]:
        started = time.monotonic()
        version = request.version
        args: dict[str, Any] = {"version": str(version), "path": request.path or ""}
        before = await engine.get_weight_version()
        held = await self.worker_status(engine)
        if held["bucket"] is None:
            raise ControlError(
                409,
                'no bucket yet: POST /init_weight_transfer_engine {"init_info": {"bucket": URL}}',
            )
        served = held["version"] == version and before == str(version)
        if served and await self._bucket_leads_nowhere(held, version):
            log.info("deltasync: version %d already served (%s sync: no-op)", version, by)
            return _answer(held, before)
        await self._settle(engine, version, args | ({"manifest": manifest} if manifest else {}))
        stage_s = time.monotonic() - started
        pause = await self._pause(engine, version)
        try:
            if pause.expired:
                raise ControlError(
                    503,
                    f"the pause passed its {self.config.pause_deadline_s:g} s deadline before "
                    f"version {version} was applied; nothing was applied and generation resumed",
                )
            status = await self._apply(engine, version, args, before)
            await engine.update_weight_version(str(status["version"]))
            cache_cleared = bool(await engine.reset_prefix_cache())
        finally:
            await self._resume(engine, pause)
        answer = _answer(status, before, stage_s, pause, cache_cleared)
        log.info(
            "deltasync: synced version %s -> %d (%s; staged %.3f s, paused %.3f s, %s bytes)",
            before,
            version,
            by,
            answer["stage_s"],
            answer["pause_s"],
            answer["bytes"],
        )
        return answer

    async def _bucket_leads_nowhere(self, held: dict[str, Any], version: int) -> bool:
        """Whether the bucket's chain plans nothing from what the workers hold to `version`
        (the same run, and its digest of that version is theirs). Any doubt (the bucket cannot
        be read, another run, a fork) is False: the full sync then decides, and reports it."""
        try:
            reading = asyncio.to_thread(read_manifest, self.store(held["bucket"]))
            manifest = await asyncio.wait_for(reading, NOOP_READ_TIMEOUT_S)
            if manifest is None:
                return False
            digest = held["state_digest"]
            return manifest.plan(held["run_id"], version, version, digest=digest) == []
        except (DeltaSyncError, TimeoutError):
            return False

    async def _settle(self, engine: Any, version: int, args: dict[str, Any]) -> None:
        """Stage `version` and wait, serving, until it is ready and no other staging runs (an
        update would wait for those inside the pause). A failed staging is an error before any
        pause; a slot that other staging calls evicted meanwhile is submitted again (3 times).
        Bounded by `stage_timeout_s` (polls back off from `poll_s` to 0.5 s)."""
        deadline = time.monotonic() + self.config.stage_timeout_s
        poll_s, resubmitted = self.config.poll_s, 0
        status = _merged(await self._call(engine, STAGE_RPC, args))
        while True:
            state = status["staging"].get(str(version), "missing")
            if state.startswith("failed"):
                kind = state.split(":", 2)[1].strip() if state.count(":") >= 2 else ""
                message = f"staging version {version} {state}; nothing was paused"
                raise ControlError(_STATUS_OF.get(kind, 500), message)
            if state == "ready" and not status.get("busy"):
                return
            evicted = state in ("missing", "cancelled")
            if evicted and resubmitted == 3:
                raise ControlError(
                    503, f"other staging requests keep evicting version {version}; try again"
                )
            if time.monotonic() > deadline:
                raise ControlError(
                    504,
                    f"staging version {version} still {state} after "
                    f"{self.config.stage_timeout_s:g} s; nothing was paused",
                )
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.5)
            resubmitted += evicted
            method, kwargs = (STAGE_RPC, args) if evicted else ("deltasync_status", None)
            status = _merged(await self._call(engine, method, kwargs))

    async def _apply(
        self, engine: Any, version: int, args: dict[str, Any], before: str
    ) -> dict[str, Any]:
        """`deltasync_apply` on every worker; the status they agree on, at `version`."""
        results = await self._call(engine, "deltasync_apply", args)
        if errors := [r for r in results if isinstance(r, dict) and r.get("error")]:
            raise ControlError(
                _STATUS_OF.get(errors[0].get("error_type"), 500),
                f"version {version} was not applied: {errors[0]['error']}",
                served_version=before,
            )
        status = _merged(results)
        if status["version"] != version:
            raise ControlError(
                500,
                f"the workers report version {status['version']} after applying {version}",
                served_version=before,
            )
        return status

    # -- the pause ---------------------------------------------------------------------------------

    async def _pause(self, engine: Any, version: int) -> _Pause:
        pause = _Pause(version, time.monotonic())
        self.pause = pause
        pause.watchdog = asyncio.create_task(self._expire(engine, pause))
        try:
            await engine.pause_generation(mode="keep")
        except Exception as exc:
            await self._resume(engine, pause)
            raise ControlError(500, f"could not pause generation: {exc}") from None
        return pause

    async def _expire(self, engine: Any, pause: _Pause) -> None:
        """The watchdog: resume generation once the pause passes its deadline."""
        await asyncio.sleep(self.config.pause_deadline_s)
        pause.expired = True
        self.pauses_expired += 1
        log.warning(
            "deltasync: the pause for version %d passed its %g s deadline: resuming generation",
            pause.version,
            self.config.pause_deadline_s,
        )
        await self._end(engine, pause)

    async def _resume(self, engine: Any, pause: _Pause) -> None:
        assert pause.watchdog is not None
        if pause.expired:
            await pause.watchdog  # it resumes (or has resumed) generation
        else:
            pause.watchdog.cancel()
            await self._end(engine, pause)

    async def _end(self, engine: Any, pause: _Pause) -> None:
        try:
            await engine.resume_generation()
        except Exception as exc:  # the engine died; /health reports it
            log.error("deltasync: could not resume generation: %s", exc)
        finally:
            pause.ended = time.monotonic()
            if self.pause is pause:
                self.pause = None

    # -- RPCs and init -----------------------------------------------------------------------------

    async def rpc(self, engine: Any, body: Any) -> dict[str, Any]:
        """`/collective_rpc` for the whitelisted `deltasync_*` methods, with checked arguments."""
        if not isinstance(body, dict):
            raise ControlError(422, "the body must be a JSON object")
        method = body.get("method")
        if not isinstance(method, str):
            raise ControlError(422, "method must be a string")
        if method not in RPC_METHODS:
            raise ControlError(
                403,
                f"method {_shown(method)} is not reachable over HTTP; allowed: "
                f"{sorted(RPC_METHODS)} (weights change only through POST {SYNC_PATH})",
            )
        if unknown := sorted(set(body) - {"method", "kwargs", "args"}):
            raise ControlError(422, f"unknown keys {unknown}; expected method, kwargs")
        if body.get("args") not in (None, []):
            raise ControlError(422, "positional args are not accepted; pass kwargs")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ControlError(422, "kwargs must be a JSON object")
        if method == STAGE_RPC:
            if unknown := sorted(set(kwargs) - {"version", "path"}):
                raise ControlError(
                    422, f"unknown {STAGE_RPC} kwargs {unknown}; expected version, path"
                )
            try:
                stage_args(kwargs.get("version"), kwargs.get("path", ""))
            except FormatError as exc:
                raise ControlError(422, f"{STAGE_RPC}: {exc}") from None
        elif method == SHARE_RPC:
            if set(kwargs) - {"start"} or kwargs.get("start", "") not in ("", "1"):
                raise ControlError(422, f'{SHARE_RPC} takes only start: "1" or ""')
        elif kwargs:
            raise ControlError(422, f"{method} takes no arguments")
        results = await self._call(engine, method, kwargs)
        if method == "deltasync_status" and self.follower is not None:
            follow = self.follower.state()
            results = [r | {"follow": follow} if isinstance(r, dict) else r for r in results]
        return {"results": results}

    async def init(self, engine: Any, body: Any) -> dict[str, Any]:
        """Point the backend at its bucket; another bucket after the first is refused (403)."""
        if not isinstance(body, dict) or set(body) != {"init_info"}:
            raise ControlError(422, 'expected {"init_info": {"bucket": URL, ...}}')
        info = _parse(InitInfo, body["init_info"], "init_info")
        async with self._held():
            results = await self._call(engine, "deltasync_init", {"init_info": body["init_info"]})
        if refusals := [r["refused"] for r in results if isinstance(r, dict) and r["refused"]]:
            raise ControlError(403, refusals[0])
        return {"message": "Weight transfer initialized", "bucket": info.bucket}

    # -- helpers -----------------------------------------------------------------------------------

    async def worker_status(self, engine: Any) -> dict[str, Any]:
        """The workers' merged `deltasync_status`: bucket, run, version and digest they hold."""
        return _merged(await self._call(engine, "deltasync_status"))

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        """The control lock, waited for at most `busy_timeout_s` (then 503)."""
        timeout_s = self.config.busy_timeout_s
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            raise ControlError(
                503, f"another sync held this replica for over {timeout_s:g} s; try again"
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    async def _call(self, engine: Any, method: str, kwargs: dict[str, Any] | None = None) -> list:
        """One RPC to every worker; 503 once the engine is dead. vLLM never answers an RPC that
        was in flight when its engine died, so the call also watches `engine.errored`."""
        rpc = asyncio.ensure_future(engine.collective_rpc(method, kwargs=kwargs or {}))
        while not (await asyncio.wait({rpc}, timeout=_DEATH_POLL_S))[0]:
            if getattr(engine, "errored", False):
                rpc.cancel()
                raise ControlError(503, f"{method} failed: the engine died")
        try:
            results = rpc.result()
        except Exception as exc:
            status = 503 if type(exc).__name__ == "EngineDeadError" else 500
            raise ControlError(status, f"{method} failed on a worker: {_first_line(exc)}") from None
        return list(results or [None])


def _answer(
    status: dict[str, Any],
    before: str,
    stage_s: float = 0.0,
    pause: _Pause | None = None,
    cache_cleared: bool = False,
) -> dict[str, Any]:
    """The sync answer: what the workers verified, and how long staging and the pause took.
    Without a pause, a no-op: the version asked for is the one served, nothing staged or paused."""
    update = status.get("last_update") or {}
    if pause is None:
        update = {"bytes": 0, "files": [], "applied": [], "swapped": False}
    return {
        "version": status["version"],
        "previous_version": before,
        "run_id": status["run_id"],
        "state_digest": status["state_digest"],
        "stage_s": round(stage_s, 4),
        "pause_s": round((pause.ended or time.monotonic()) - pause.started, 4) if pause else 0.0,
        "apply_s": update.get("apply_s"),
        "commit_s": update.get("commit_s"),
        "bytes": update.get("bytes"),
        "files": update.get("files"),
        "applied": update.get("applied"),
        "swapped": update.get("swapped"),
        "prefix_cache_cleared": cache_cleared,
        "pause_expired": pause is not None and pause.expired,
        "noop": pause is None,
    }


def _parse(cls: type, raw: Any, what: str) -> Any:
    try:
        return parse_message(cls, raw, what)
    except ValueError as exc:  # FormatError is one
        raise ControlError(422, str(exc)) from None


def _merged(results: list[Any]) -> dict[str, Any]:
    try:
        return merge_statuses(results)
    except FormatError as exc:
        raise ControlError(500, str(exc)) from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:2000]
