"""TRL `weight_transfer=` backend: publish through the bucket, then drive every rollout replica.

TRL calls `pause()`, `send_weights(iterator)`, `resume()` after each optimizer step. Here `pause`
and `resume` are no-ops: `send_weights` only diffs the live weights (bitwise, against the last
published bf16 snapshot) and hands the version to the background. One driver thread per driven
replica then syncs it to the newest committed version as soon as it is free - one sync in flight
per replica, a newer commit supersedes versions it has not started - by staging the file while it
serves and sending its one sync request (`ReplicaClient.sync_to`): the replica pauses, applies,
verifies, records the version and resumes by itself, with no round trip to the trainer inside the
pause. A replica counts as synced at version v only once it reports v. Followers (`serve
--follow`) sync themselves; the trainer polls the version each serves.

Each version's commit-to-serving latency per replica runs from its `send_weights` (the
`publish()` call) until the replica is seen serving it or a newer version. A separate finisher
writes the version's one metrics record (`deltasync.wire.metrics.SyncRecord`), in version order:
the publisher's fields, every replica's outcome and latency, and the reward TRL logged at the
step that produced the version (`trainer.rewards`). Its waits (outcomes, the reward) delay only
records, never a sync. The publisher writes none (`PublisherConfig(write_metrics=False)`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace

import torch

from deltasync import Publisher
from deltasync.errors import DeltaSyncError
from deltasync.publisher.snapshot import bf16_view
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.digests import tensor_digest
from deltasync.wire.manifest import metrics_path, read_manifest
from deltasync.wire.metrics import ReplicaOutcome, SyncRecord

from .console import console, latency_summary, version_line
from .rewards import StepRewards

__all__ = ["BucketWeightTransfer", "SyncState"]

log = logging.getLogger("trainer.weight_sync")


@dataclass
class SyncState:
    """What the trainer knows about each replica: the last version it verified."""

    synced: dict[str, int] = field(default_factory=dict)
    lagging: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Seen:
    """A replica seen serving `version` at `at` (perf_counter), by a driven sync's answer or a
    follower's poll (`outcome`: that sync's, or the poll's)."""

    version: int
    at: float
    outcome: ReplicaOutcome

    def outcome_for(self, pending: _Pending) -> ReplicaOutcome:
        """The outcome of `pending`'s version: latency from its hand-over; a driven replica that
        went straight past it applied nothing for it (its pause belongs to `version`)."""
        assert pending.record is not None
        applied = self.outcome.following or pending.record.version == self.version
        base = self.outcome if applied else replace(self.outcome, stage_s=0, pause_s=0, total_s=0)
        # never negative, even for a replica seen at this number before (an earlier trainer)
        latency = max(0.0, self.at - pending.started)
        return replace(base, latency_s=latency, served_version=self.version)


@dataclass
class _Pending:
    """A handed-over version until its record is written; outcomes arrive per replica."""

    started: float
    step: int | None
    expected: dict[str, str] | None
    committed: Future[SyncRecord]
    record: SyncRecord | None = None  # set at commit
    outcomes: dict[str, ReplicaOutcome] = field(default_factory=dict)
    last_outcome_at: float | None = None

    def add(self, outcome: ReplicaOutcome) -> None:
        self.outcomes[outcome.name] = outcome
        self.last_outcome_at = time.perf_counter()


class BucketWeightTransfer:
    """Implements TRL's `WeightTransferProtocol` on top of a `deltasync.Publisher`.

    Args:
        publisher: writes versions to the bucket (owns the bf16 snapshot).
        replicas: one client per rollout server (`--vllm-server-url`, possibly several).
        bucket: the bucket URL the replicas read (for log lines).
        attempts: tries per replica and sync before it is reported as lagging; a lagging
            replica is caught up from the bucket at the next version.
        verify_digests: after each sync also compare every served tensor's digest (replica RPC)
            with the trainer's bf16 view (a full hash pass on both sides; for tests and audits);
            for a tensor-parallel replica, the full-state digest its workers recompute.
        rewards: TRL's logged reward per step (`trainer.rewards.RewardCallback` fills it); each
            version is tagged with the step current at `send_weights` and gets that step's
            reward. None: records carry no step and no reward.
        reward_wait_s: how long a version's record waits for its step's reward to be logged.
        followers: rollout servers that follow the bucket themselves (`serve --follow`): never
            synced by the trainer, so its work per version does not grow with them; their
            served version (each verifies what it serves) is read every `poll_s`, for routing
            and for their latency (so measured to within `poll_s`).
        follower_wait_s: how long a version's record waits for a follower to be seen serving it
            before recording it as not served.
        stopped: whether rollouts stopped for good (every replica down): `destroy` then does
            not wait for syncs, which may be blocked on a dead engine that never answers.
        state: where the versions each replica serves are kept (the rollout gate reads the
            same object); a new one by default.

    Raises:
        ValueError: the publisher writes metrics records itself (a record needs one writer).
    """

    def __init__(
        self,
        publisher: Publisher,
        replicas: dict[str, ReplicaClient],
        *,
        bucket: str,
        attempts: int = 2,
        verify_digests: bool = False,
        rewards: StepRewards | None = None,
        reward_wait_s: float = 30.0,
        followers: dict[str, ReplicaClient] | None = None,
        poll_s: float = 1.0,
        follower_wait_s: float = 120.0,
        stopped: Callable[[], bool] = lambda: False,
        state: SyncState | None = None,
    ):
        if publisher.config.write_metrics:
            raise ValueError(
                "the publisher writes metrics records itself; build it with "
                "PublisherConfig(write_metrics=False): BucketWeightTransfer writes each record "
                "once, complete with replica outcomes and the reward"
            )
        self.publisher = publisher
        self.replicas = replicas
        self.bucket = bucket
        self.attempts = attempts
        self.verify_digests = verify_digests
        self.state = SyncState() if state is None else state
        self.rewards = rewards
        self.reward_wait_s = reward_wait_s
        self.records: list[SyncRecord] = []
        self._order = ThreadPoolExecutor(1, thread_name_prefix="deltasync-record")
        self._pending: list[Future[SyncRecord]] = []
        self._lock = threading.Lock()
        self._versions: list[_Pending] = []  # handed over, record not written yet; in order
        self._seen: dict[str, _Seen] = {}
        self._changed = threading.Condition()  # guards _versions, their outcomes, _seen
        self._closing = False
        self._drivers = [
            threading.Thread(target=self._drive, args=(n,), name=f"sync-{n}", daemon=True)
            for n in replicas
        ]
        self.followers = followers or {}
        self._poll_s = poll_s
        self._follower_wait_s = follower_wait_s
        self._stopped = stopped
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="followers", daemon=True)

    def init_weight_transfer(self) -> None:
        """Wait until every replica answers, point the driven ones at the bucket and start
        their drivers, and start reading the followers' served versions."""
        for name, client in {**self.replicas, **self.followers}.items():
            deadline = time.monotonic() + 300
            while not client.healthy():
                if time.monotonic() > deadline:
                    raise DeltaSyncError(f"rollout server {name} did not become healthy in 300 s")
                time.sleep(1)
            if name in self.replicas:
                client.init(self.bucket)
        for driver in self._drivers:
            driver.start()
        if self.followers:
            self._poller.start()

    def _poll(self) -> None:
        """The followers' served versions, for routing and latency: one cheap read each per
        `poll_s`."""
        while not self._stop.wait(self._poll_s):
            for name, client in self.followers.items():
                try:
                    served = int(client.weight_version())
                except (DeltaSyncError, ValueError, OSError):  # down, or nothing verified yet
                    self.state.lagging.add(name)
                    continue
                self.state.synced[name] = served
                self.state.lagging.discard(name)
                seen = ReplicaOutcome(name, True, 1, following=True)
                self._observe(_Seen(served, time.perf_counter(), seen))

    def pause(self) -> None:
        """Nothing to do: replicas keep serving while the version uploads and stages."""

    def resume(self) -> None:
        """Nothing to do: each replica is paused only around its own apply."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Diff now (TRL's tensors are live views), upload and sync replicas in the background.

        The version is tagged with the trainer's current step: TRL calls this from `on_step_end`
        of that step (step 0: the initial sync at train begin).
        """
        started = time.perf_counter()
        step = self.rewards.current_step() if self.rewards is not None else None
        named = _materialise(iterator)
        future = self.publisher.publish(named)
        names = self.publisher.names
        expected = (
            {
                n: tensor_digest(bf16_view(t))
                for n, t in (named if names is None else names.apply(named))
            }
            if self.verify_digests
            else None
        )
        pending = _Pending(started, step, expected, future)
        with self._changed:
            self._versions.append(pending)
        future.add_done_callback(lambda _: self._on_commit(pending))
        cold = not self.state.synced  # rollouts begin once a replica serves a version
        # A cold sync blocks this thread, which logs the step's reward only after we return.
        wait_s = 0.0 if cold else self.reward_wait_s
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            record = self._order.submit(self._finish, pending, wait_s)
            record.add_done_callback(_log_failure)
            self._pending.append(record)
        if cold:
            self._await_cold(pending)

    def destroy(self) -> None:
        """Let queued syncs and records finish (bounded), then stop the publisher."""
        with self._changed:
            self._closing = True  # drivers end once nothing is left to sync
            self._changed.notify_all()
        if self.rewards is not None:
            self.rewards.end()  # no more logs: pending records stop waiting for rewards
        with self._lock:
            pending = [f for f in self._pending if not f.done()]
        if self._stopped():
            # vLLM never answers an RPC that was in flight when its engine died: a sync may
            # block until its request times out, and nothing it could finish matters now
            log.warning("rollouts stopped: not waiting for %d replica syncs", len(pending))
            self._stop.set()
            self.publisher.close(timeout=600)
            self._order.shutdown(wait=False, cancel_futures=True)
            return
        futures_wait(pending, timeout=600)  # never raises; failures were logged by _log_failure
        self._stop.set()  # polled until now: the last records wait for the followers
        self.publisher.close(timeout=600)
        self._order.shutdown(wait=True)
        for driver in self._drivers:
            if driver.is_alive():  # started by init_weight_transfer
                driver.join(timeout=60)

    def wait(self, timeout: float = 600) -> list[SyncRecord]:
        """Block until every version handed over so far is recorded; returns their records."""
        with self._lock:
            pending = list(self._pending)
        return [f.result(timeout=timeout) for f in pending]

    def latency_summary(self) -> str:
        """Commit-to-serving latency p50 / p95 per replica over the versions recorded so far,
        for the end-of-run summary."""
        return latency_summary(self.records)

    def _on_commit(self, pending: _Pending) -> None:
        """The version has its number: replicas already seen at or past it have served it."""
        with self._changed:
            if pending.committed.exception() is None:
                pending.record = pending.committed.result()
                for seen in self._seen.values():
                    if seen.version >= pending.record.version:
                        pending.add(seen.outcome_for(pending))
            self._changed.notify_all()

    def _observe(self, seen: _Seen) -> None:
        """A replica serves `seen.version`: every committed version up to it is served there."""
        name = seen.outcome.name
        with self._changed:
            self._seen[name] = seen
            for pending in self._unsettled(name, seen.version):
                pending.add(seen.outcome_for(pending))
            self._changed.notify_all()

    def _fail(self, outcome: ReplicaOutcome, through: int) -> None:
        """A driven replica's sync failed: versions up to `through` were not served there."""
        with self._changed:
            for pending in self._unsettled(outcome.name, through):
                pending.add(outcome)
            self._changed.notify_all()

    def _unsettled(self, name: str, through: int) -> list[_Pending]:
        """Committed versions up to `through` without an outcome for `name` (lock held)."""
        return [
            p
            for p in self._versions
            if p.record is not None and p.record.version <= through and name not in p.outcomes
        ]

    def _await_cold(self, pending: _Pending, timeout_s: float = 1800) -> None:
        """At the cold start, block until every driven replica answered version 1 (without
        driven ones: until a follower serves it); nothing can generate before."""
        with self._changed:
            answered = self._changed.wait_for(
                lambda: (
                    pending.committed.done()
                    and (pending.committed.exception() is not None or self._cold_served(pending))
                ),
                timeout_s,
            )
        pending.committed.result()  # a failed publish raises here
        if not answered:
            raise DeltaSyncError(f"no replica served the first version in {timeout_s:.0f} s")

    def _cold_served(self, pending: _Pending) -> bool:
        if self.replicas:
            return all(n in pending.outcomes for n in self.replicas)
        return any(o.ok for o in pending.outcomes.values())

    def _drive(self, name: str) -> None:
        """One replica's syncs, one at a time, each to the newest committed version."""
        while (pending := self._next_for(name)) is not None:
            record = pending.record
            assert record is not None
            path = record.delta_path or record.anchor_path
            try:
                outcome, seen = self._sync_one(name, record.version, path, pending.expected)
            except Exception as exc:  # a bug must not leave the version's record waiting
                log.exception("replica %s: sync to version %d raised", name, record.version)
                outcome, seen = ReplicaOutcome(name, False, 1, error=repr(exc)), None
            if seen is not None:
                self._observe(seen)
            else:
                self._fail(outcome, record.version)

    def _next_for(self, name: str) -> _Pending | None:
        """The newest committed version `name` has no outcome for (older ones it skips: the
        sync to the newest serves them too); None once closing with nothing left."""
        with self._changed:
            while True:
                todo = [
                    p for p in self._versions if p.record is not None and name not in p.outcomes
                ]
                if todo:
                    return todo[-1]
                if self._closing and all(p.committed.done() for p in self._versions):
                    return None
                self._changed.wait()

    def _finish(self, pending: _Pending, reward_wait_s: float) -> SyncRecord:
        """The version's one record, once every replica has an outcome and the reward is in."""
        try:
            record = pending.committed.result()
            for line in record.log_lines(self.bucket):
                log.info("%s", line)
            outcomes = self._outcomes(pending, record.version)
        finally:
            with self._changed:
                self._versions.remove(pending)
        sync_s = (pending.last_outcome_at or time.perf_counter()) - pending.started
        log.info(
            "Weight sync: done. Total %.1fs (inference paused %.1fs)%s",
            sync_s,
            max((r.pause_s for r in outcomes), default=0.0),
            ""
            if all(r.ok for r in outcomes)
            else f"; lagging: {sorted(r.name for r in outcomes if not r.ok)}",
        )
        reward = (
            self.rewards.reward(pending.step, reward_wait_s) if self.rewards is not None else None
        )
        complete = record.with_sync(outcomes, sync_s=sync_s, step=pending.step, reward_mean=reward)
        self._write_metrics(complete)
        self.records.append(complete)
        console.info("%s", version_line(complete))
        return complete

    def _outcomes(self, pending: _Pending, version: int) -> tuple[ReplicaOutcome, ...]:
        """Every replica's outcome: driven ones always answer (or fail); a follower not seen
        serving the version within `follower_wait_s` is recorded as not served."""
        names = [*self.replicas, *self.followers]
        deadline = time.monotonic() + self._follower_wait_s
        with self._changed:
            while missing := [n for n in names if n not in pending.outcomes]:
                late = time.monotonic() >= deadline
                if late and not any(n in self.replicas for n in missing):
                    break
                self._changed.wait(None if late else deadline - time.monotonic())
            for name in missing:
                error = f"not seen serving version {version} in {self._follower_wait_s:.0f} s"
                pending.add(ReplicaOutcome(name, False, 1, error=error, following=True))
            return tuple(pending.outcomes[n] for n in names)

    def _sync_one(
        self, name: str, version: int, path: str | None, expected: dict[str, str] | None
    ) -> tuple[ReplicaOutcome, _Seen | None]:
        """Sync `name` to `version` (or the newest committed); its outcome, and what it was seen
        serving when its sync answered (None: it failed every attempt)."""
        client = self.replicas[name]
        started = time.perf_counter()
        error = None
        for attempt in range(1, self.attempts + 1):
            # A sync that waited while newer versions were committed goes straight to the newest:
            # retention may already have deleted the files of `version` (a replica never needs
            # an old version), and a late or retried sync plans from the manifest, so the file's
            # path (which only saves the replica a manifest lookup) is sent only when current.
            target = max(version, self.publisher.committed_version or version)
            hint = path if attempt == 1 and target == version else None
            try:
                timings = client.sync_to(target, hint)
                answered = time.perf_counter()  # serving `target` from here on
                served = int(client.weight_version())
                if served < target:
                    raise DeltaSyncError(f"replica reports version {served}, expected {target}")
                if expected is not None:
                    self._check_served(client, served, expected if served == version else None)
            except (DeltaSyncError, ValueError, OSError) as exc:
                error = str(exc)
                log.warning(
                    "replica %s: sync to version %d failed (attempt %d/%d): %s",
                    name,
                    version,
                    attempt,
                    self.attempts,
                    exc,
                )
                continue
            self.state.synced[name] = served
            self.state.lagging.discard(name)
            outcome = ReplicaOutcome(
                name,
                True,
                attempt,
                _seconds(timings.get("stage_s")),
                _seconds(timings.get("pause_s")),
                time.perf_counter() - started,
            )
            return outcome, _Seen(served, answered, outcome)
        self.state.lagging.add(name)
        log.error(
            "replica %s is lagging at version %s; it catches up from the bucket next time",
            name,
            self.state.synced.get(name),
        )
        failed = ReplicaOutcome(
            name, False, self.attempts, total_s=time.perf_counter() - started, error=error
        )
        return failed, None

    def _check_served(
        self, client: ReplicaClient, version: int, expected: dict[str, str] | None
    ) -> None:
        """Whole-tensor digests against the trainer's (`expected`); without them (a replica
        synced past the version they are of) or for a tensor-parallel replica, whose workers
        hold slices, the full-state digest recomputed now over what its workers serve must be
        the one the manifest gives `version`."""
        report = client.digests() if expected is not None else {"workers": True}
        if report.get("workers") is None:
            _check_digests(report["digests"], expected or {})
            return
        manifest = read_manifest(self.publisher.store)
        promised = None if manifest is None else manifest.version_digest(version)
        served_version, served = client.served_state_digest()
        if served_version != version or served is None or served.hex() != promised:
            raise DeltaSyncError(
                f"replica's served full-state digest {served} (version {served_version}) is not "
                f"version {version}'s {promised}"
            )

    def _write_metrics(self, record: SyncRecord) -> None:
        """The version's one metrics record, written once its replicas are done."""
        try:
            self.publisher.store.put(metrics_path(record.run_id, record.version), record.to_json())
        except DeltaSyncError as exc:
            log.warning("metrics record for version %d not written: %s", record.version, exc)


def _log_failure(sync: Future[SyncRecord]) -> None:
    """A sync that raised loses its replica outcomes: say so when it happens."""
    if not sync.cancelled() and sync.exception() is not None:
        log.error("weight sync failed", exc_info=sync.exception())


def _seconds(value: object) -> float:
    """A replica's reported duration; anything but a finite number >= 0 counts as 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
        return float(value)
    return 0.0


def _check_digests(served: dict[str, str], expected: dict[str, str]) -> None:
    """The replica serves exactly the trainer's bf16 bytes (tied aliases appear under one name)."""
    wrong = sorted(n for n, d in expected.items() if served.get(n) != d)
    if wrong:
        raise DeltaSyncError(f"served weights differ from the trainer's in {wrong[:5]}")


def _materialise(iterator: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """TRL yields live parameter views; the publisher diffs them before returning."""
    return list(iterator)
