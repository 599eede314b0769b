"""Pull mode: a rollout server follows its bucket's manifest by itself (`serve --follow`).

A `Follower` runs in vLLM's API server process beside `control.ControlPlane` and changes weights
only through `ControlPlane.sync_version`, the sync route's own path: the same lock (a trainer's
push and the follower never interleave), the same staging while serving, the same pause, apply,
verification and record. Each poll, every `interval_s` (+-`jitter`):

1. reads the manifest's bytes (`read_manifest_bytes`: one read for a manifest up to 1 MiB,
   never more than the manifest limit); bytes it has already handled end the poll there;
2. otherwise asks the workers what they hold and plans with the one chain planner
   (`Manifest.plan`), which also refuses a fork and a manifest behind the served version;
3. syncs to the manifest's latest version, handing the workers the bytes it read: their
   staging parses and checks them as if it had read them and plans from them (the latest
   anchor or the deltas, whichever is cheaper), so a version costs one manifest read and its
   files. A replica that fell behind replays through an anchor, and a file that retention
   deleted mid-download fails this sync and is planned around at the next poll.

It never goes backwards: a manifest behind the served version, a fork, an older run or a version
the replica refuses (409) is logged once and ignored until the manifest changes (looked at again
every `max_backoff_s`). A bucket that cannot be read, or a sync that fails otherwise, is retried
with exponential backoff up to `max_backoff_s`; the replica keeps serving its verified version.
One log line per change of state, none per poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deltasync.errors import ChainError, DeltaSyncError, FormatError
from deltasync.store import Store
from deltasync.vllm_ext.protocol import SyncRequest
from deltasync.vllm_ext.server.control import ControlError, ControlPlane
from deltasync.wire.digests import bytes_digest
from deltasync.wire.manifest import Manifest, read_manifest_bytes

__all__ = ["FollowConfig", "Follower"]

log = logging.getLogger("deltasync.follow")


@dataclass(frozen=True)
class FollowConfig:
    """Settings of a follower (`serve --follow-interval`; the rest are fixed defaults).

    Attributes:
        interval_s: seconds between polls of the manifest while all is well.
        jitter: each wait is scaled by a random factor in [1 - jitter, 1 + jitter], so a fleet
            started together does not poll the bucket in step.
        max_backoff_s: longest wait after failures (the waits double from `interval_s`), and
            how often a manifest that was ignored is looked at again.
        read_timeout_s: longest wait for one read of the manifest before it counts as failed.
    """

    interval_s: float = 2.0
    jitter: float = 0.2
    max_backoff_s: float = 30.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "max_backoff_s", "read_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {value!r}")
        if not isinstance(self.jitter, (int, float)) or not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")


class _Failed(Exception):
    """A poll that got no usable answer (the bucket, or a sync that was not refused): retried
    with backoff. `kind` names the failure in `/health` and decides when to log it again."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Follower:
    """Follows the bucket the workers were pointed at; one per API server process.

    Args:
        control: the server's control plane; every sync goes through its `sync_version`.
        config: poll interval and backoff.
        rng: the source of jitter (tests pass a seeded one).
    """

    def __init__(
        self,
        control: ControlPlane,
        config: FollowConfig | None = None,
        *,
        rng: random.Random | None = None,
    ):
        self.control = control
        self.config = config or FollowConfig()
        self._rng = rng or random.Random()
        self._task: asyncio.Task | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="deltasync-follow")
        self._store: Store | None = None
        self._handled: str | None = None  # digest of the manifest bytes dealt with last
        self._recheck_at: float | None = None  # when an ignored manifest is looked at again
        self._followed_at: float | None = None  # `updated_at` of the newest manifest followed
        self._logged: tuple[str, str] | None = None
        self._failing_since = 0.0
        self.status = "starting"
        self.bucket: str | None = None
        self.last_poll_at: float | None = None
        self.last_error: str | None = None
        self.last_error_kind: str | None = None
        self.last_error_at: float | None = None
        self.failures = 0  # consecutive failed polls
        self.bucket_version: int | None = None
        self.served_version: int | None = None
        self.versions_behind: int | None = None
        self.synced = 0
        self.last_sync: dict[str, Any] | None = None

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self, engine: Any) -> None:
        """Start polling in the running event loop (the server's), once."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(engine), name="deltasync-follow")

    async def stop(self) -> None:
        """Stop polling (server shutdown); a sync under way is cancelled, which resumes
        generation on its way out."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._reader.shutdown(wait=False, cancel_futures=True)

    async def _run(self, engine: Any) -> None:
        while True:
            try:
                delay = await self.poll(engine)
            except Exception as exc:  # a bug must not end following; it is reported like others
                delay = self._failed(_Failed("internal", f"{type(exc).__name__}: {exc}"))
            await asyncio.sleep(delay)

    # -- one poll -------------------------------------------------------------------------------

    async def poll(self, engine: Any) -> float:
        """Look at the bucket once and sync when it moved; returns the seconds to wait next."""
        self.last_poll_at = time.time()
        try:
            await self._poll(engine)
        except _Failed as failed:
            return self._failed(failed)
        if self.failures:
            log.info(
                "deltasync: follow: following again after %d failed polls over %.0f s",
                self.failures,
                time.monotonic() - self._failing_since,
            )
            self.failures = 0
        return self._jittered(self.config.interval_s)

    async def _poll(self, engine: Any) -> None:
        if self._store is None and not await self._open(engine):
            return
        data = await self._read()
        key = None if data is None else bytes_digest(data)
        recheck = self._recheck_at is not None and time.monotonic() >= self._recheck_at
        if key is not None and key == self._handled and not recheck:
            return
        held = await self._held(engine)
        if data is None:
            if held["version"] is None:
                self._note("empty", "", "the bucket is empty: waiting for its first version")
                return
            raise _Failed(
                "no manifest", f"the bucket has no manifest ({self.bucket} unreachable, or emptied)"
            )
        try:
            manifest = Manifest.from_json(data)
        except FormatError as exc:
            raise _Failed("unreadable manifest", f"the manifest is unusable: {exc}") from None
        self.bucket_version = manifest.latest_version
        await self._follow(engine, manifest, data, held, key)

    async def _follow(
        self, engine: Any, manifest: Manifest, data: bytes, held: dict[str, Any], key: str | None
    ) -> None:
        """Sync to the manifest's latest version unless it is not ahead of what is served."""
        run, version = held["run_id"], held["version"]
        same_run = run == manifest.run_id and version is not None
        behind = max(0, manifest.latest_version - (version if same_run else 0))
        self.versions_behind = behind if same_run or version is None else None
        if not same_run and version is not None and self._older_run(manifest):
            return self._ignore(
                key,
                "older run",
                f"the bucket holds run {manifest.run_id}, committed before the run {run} this "
                "replica follows",
            )
        try:
            route = manifest.plan(run, version, digest=held["state_digest"])
        except ChainError as exc:  # behind the served version, or a fork
            return self._ignore(key, "chain", str(exc))
        if not route:
            self._handled, self._recheck_at, self._followed_at = key, None, manifest.updated_at
            self.versions_behind = 0
            return self._note("up to date", "")
        if version is not None and route[0].kind == "anchor":
            self._note(
                "syncing",
                "anchor",
                f"{_behind(self.versions_behind) if same_run else 'another run'}"
                f": replaying from the anchor at version {route[0].version} "
                f"(+{len(route) - 1} deltas), the cheaper route",
            )
        await self._sync(engine, manifest, data, version, key)

    async def _sync(
        self, engine: Any, manifest: Manifest, data: bytes, version: int | None, key: str | None
    ) -> None:
        """Sync to `manifest` (read as `data`) through the control plane's path; the workers
        stage from `data` instead of reading the manifest again."""
        target = manifest.latest_version
        self.status = "syncing"
        request = SyncRequest(target)
        try:
            answer = await self.control.sync_version(engine, request, by="follow", manifest=data)
        except ControlError as exc:
            if exc.status in (409, 422):  # this replica cannot take that version as it stands
                return self._ignore(key, "refused", f"version {target} was refused: {exc}")
            raise _Failed(f"sync {exc.status}", f"sync to version {target} failed: {exc}") from None
        self._handled, self._recheck_at, self._followed_at = key, None, manifest.updated_at
        self.served_version, self.versions_behind = answer["version"], 0
        self.synced += 1
        synced = {"version": answer["version"], "previous_version": version, "at": time.time()}
        self.last_sync = synced | {name: answer[name] for name in ("files", "bytes", "pause_s")}
        self._note("up to date", "")

    def _older_run(self, manifest: Manifest) -> bool:
        """A manifest of another run that was committed before the newest one followed (a stale
        read of a run the bucket held earlier): not a reason to load that run again."""
        return self._followed_at is not None and manifest.updated_at <= self._followed_at

    # -- the bucket and the workers ------------------------------------------------------------

    async def _open(self, engine: Any) -> bool:
        """The bucket the workers follow, once they were pointed at one (the launcher does)."""
        bucket = (await self._held(engine))["bucket"]
        if bucket is None:
            self._note("waiting", "", "waiting for the bucket (POST /init_weight_transfer_engine)")
            return False
        try:
            self._store = self.control.store(bucket)
        except DeltaSyncError as exc:
            raise _Failed("open", f"cannot open the bucket {bucket}: {exc}") from None
        self.bucket = bucket
        log.info(
            "deltasync: follow: polling %s every %g s (+-%d %%)",
            bucket,
            self.config.interval_s,
            round(100 * self.config.jitter),
        )
        return True

    async def _read(self) -> bytes | None:
        """The manifest's bytes (None: no manifest), read in a thread, bounded in size and time."""
        loop = asyncio.get_running_loop()
        reading = loop.run_in_executor(self._reader, read_manifest_bytes, self._store)
        try:
            return await asyncio.wait_for(reading, self.config.read_timeout_s)
        except TimeoutError:
            raise _Failed(
                "timeout", f"reading the manifest took over {self.config.read_timeout_s:g} s"
            ) from None
        except DeltaSyncError as exc:
            raise _Failed(type(exc).__name__, f"cannot read the manifest: {exc}") from None

    async def _held(self, engine: Any) -> dict[str, Any]:
        try:
            held = await self.control.worker_status(engine)
        except ControlError as exc:
            raise _Failed("workers", f"the workers did not answer: {exc}") from None
        self.served_version = held["version"]
        return held

    # -- state and log ---------------------------------------------------------------------------

    def _ignore(self, key: str | None, kind: str, why: str) -> None:
        self._handled = key
        self._recheck_at = time.monotonic() + self.config.max_backoff_s
        message = f"{why}; keeping version {self.served_version} until the bucket moves on"
        self.last_error, self.last_error_kind, self.last_error_at = message, kind, time.time()
        self._note("ignoring", kind, message, logging.WARNING)

    def _failed(self, failed: _Failed) -> float:
        if not self.failures:
            self._failing_since = time.monotonic()
        self.failures += 1
        self.last_error, self.last_error_kind = str(failed), failed.kind
        self.last_error_at = time.time()
        cap = max(self.config.max_backoff_s, self.config.interval_s)
        delay = self._jittered(min(cap, self.config.interval_s * 2**self.failures))
        serving = f"serving version {self.served_version}, retrying with backoff (up to {cap:g} s)"
        self._note("retrying", failed.kind, f"{failed}; {serving}", logging.WARNING)
        return delay

    def _note(
        self, status: str, kind: str, message: str | None = None, level: int = logging.INFO
    ) -> None:
        """Enter `status`; log `message` only when the status (or its kind) changed."""
        self.status = status
        if (status, kind) != self._logged:
            self._logged = (status, kind)
            if message:
                log.log(level, "deltasync: follow: %s", message)

    def _jittered(self, seconds: float) -> float:
        spread = self.config.jitter
        return seconds * self._rng.uniform(1 - spread, 1 + spread)

    def state(self, *, public: bool = False) -> dict[str, Any]:
        """What the follower does and saw last. `public` (for `/health`, which needs no token):
        the last error's kind instead of its message, which can name the bucket, and no last
        sync (its file names)."""
        state = {
            "following": True,
            "status": self.status,
            "interval_s": self.config.interval_s,
            "last_poll_at": self.last_poll_at,
            "bucket_version": self.bucket_version,
            "served_version": self.served_version,
            "versions_behind": self.versions_behind,
            "failures": self.failures,
            "last_error": self.last_error_kind if public else self.last_error,
            "last_error_at": self.last_error_at,
            "synced": self.synced,
        }
        if not public:
            state["last_sync"] = None if self.last_sync is None else dict(self.last_sync)
        return state


def _behind(versions: int | None) -> str:
    return f"{versions} version{'' if versions == 1 else 's'} behind"
