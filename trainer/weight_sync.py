"""TRL `weight_transfer=` backend: publish through the bucket, then drive every rollout replica.

TRL calls `pause()`, `send_weights(iterator)`, `resume()` after each optimizer step. Here `pause`
and `resume` are no-ops: `send_weights` only diffs the live weights (bitwise, against the last
published bf16 snapshot) and hands the version to the background. A sync thread then waits for
the commit and, for every replica in parallel, has it stage the file while it serves, then sends
its one sync request (`ReplicaClient.sync_to`): the replica pauses, applies, verifies, records the
version and resumes by itself, with no round trip to the trainer inside the pause. A replica
counts as synced at version v only once it reports v.
Then it writes the version's one metrics record (`deltasync.wire.metrics.SyncRecord`): the
publisher's fields, every replica's outcome, and the reward TRL logged at the step that produced
the version (`trainer.rewards`); the publisher itself writes none
(`PublisherConfig(write_metrics=False)`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch

from deltasync import Publisher
from deltasync.errors import DeltaSyncError
from deltasync.publisher.snapshot import bf16_view
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.digests import tensor_digest
from deltasync.wire.manifest import metrics_path, read_manifest
from deltasync.wire.metrics import ReplicaOutcome, SyncRecord

from .console import console, version_line
from .rewards import StepRewards

__all__ = ["BucketWeightTransfer"]

log = logging.getLogger("trainer.weight_sync")


@dataclass
class _State:
    """What the trainer knows about each replica: the last version it verified."""

    synced: dict[str, int] = field(default_factory=dict)
    lagging: set[str] = field(default_factory=set)


class BucketWeightTransfer:
    """Implements TRL's `WeightTransferProtocol` on top of a `deltasync.Publisher`.

    Args:
        publisher: writes versions to the bucket (owns the bf16 snapshot).
        replicas: one client per rollout server (`--vllm-server-url`, possibly several).
        bucket: the bucket URL the replicas read (for log lines).
        attempts: tries per replica and version before it is reported as lagging; a lagging
            replica is caught up from the bucket at the next version.
        verify_digests: after each sync also compare every served tensor's digest (replica RPC)
            with the trainer's bf16 view (a full hash pass on both sides; for tests and audits);
            for a tensor-parallel replica, the full-state digest its workers recompute.
        rewards: TRL's logged reward per step (`trainer.rewards.RewardCallback` fills it); each
            version is tagged with the step current at `send_weights` and gets that step's
            reward. None: records carry no step and no reward.
        reward_wait_s: how long a finished sync waits for its step's reward to be logged.
        followers: rollout servers that follow the bucket themselves (`serve --follow`): never
            synced by the trainer, so its work per version does not grow with them; their
            served version (each verifies what it serves) is read every `poll_s` for routing.
        stopped: whether rollouts stopped for good (every replica down): `destroy` then does
            not wait for syncs, which may be blocked on a dead engine that never answers.

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
        stopped: Callable[[], bool] = lambda: False,
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
        self.state = _State()
        self.rewards = rewards
        self.reward_wait_s = reward_wait_s
        self.records: list[SyncRecord] = []
        self._order = ThreadPoolExecutor(1, thread_name_prefix="deltasync-sync")
        self._fanout = ThreadPoolExecutor(max(1, len(replicas)), thread_name_prefix="replica")
        self._pending: list[Future[SyncRecord]] = []
        self._lock = threading.Lock()
        self.followers = followers or {}
        self._poll_s = poll_s
        self._stopped = stopped
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="followers", daemon=True)

    def init_weight_transfer(self) -> None:
        """Wait until every replica answers, point the driven ones at the bucket, and start
        reading the followers' served versions."""
        for name, client in {**self.replicas, **self.followers}.items():
            deadline = time.monotonic() + 300
            while not client.healthy():
                if time.monotonic() > deadline:
                    raise DeltaSyncError(f"rollout server {name} did not become healthy in 300 s")
                time.sleep(1)
            if name in self.replicas:
                client.init(self.bucket)
        if self.followers:
            self._poller.start()

    def _poll(self) -> None:
        """The followers' served versions, for routing: one cheap read each per `poll_s`."""
        while not self._stop.wait(self._poll_s):
            for name, client in self.followers.items():
                try:
                    served = int(client.weight_version())
                except (DeltaSyncError, ValueError, OSError):  # down, or nothing verified yet
                    self.state.lagging.add(name)
                    continue
                self.state.synced[name] = served
                self.state.lagging.discard(name)

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
        cold = not self.state.synced  # rollouts begin once a replica serves a version
        # A cold sync blocks this thread, which logs the step's reward only after we return.
        wait_s = 0.0 if cold else self.reward_wait_s
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            sync = self._order.submit(self._finish, future, started, expected, step, wait_s, cold)
            sync.add_done_callback(_log_failure)
            self._pending.append(sync)
        if cold:
            sync.result(timeout=1800)

    def destroy(self) -> None:
        """Let queued syncs finish (bounded), then stop the publisher."""
        self._stop.set()
        if self.rewards is not None:
            self.rewards.end()  # no more logs: pending syncs stop waiting for rewards
        with self._lock:
            pending = [f for f in self._pending if not f.done()]
        if self._stopped():
            # vLLM never answers an RPC that was in flight when its engine died: a sync may
            # block until its request times out, and nothing it could finish matters now
            log.warning("rollouts stopped: not waiting for %d replica syncs", len(pending))
            self.publisher.close(timeout=600)
            self._order.shutdown(wait=False, cancel_futures=True)
            self._fanout.shutdown(wait=False, cancel_futures=True)
            return
        futures_wait(pending, timeout=600)  # never raises; failures were logged by _log_failure
        self.publisher.close(timeout=600)
        self._order.shutdown(wait=True)
        self._fanout.shutdown(wait=True)

    def wait(self, timeout: float = 600) -> list[SyncRecord]:
        """Block until every sync handed over so far has finished; returns their records."""
        with self._lock:
            pending = list(self._pending)
        return [f.result(timeout=timeout) for f in pending]

    def _finish(
        self,
        future: Future[SyncRecord],
        started: float,
        expected: dict[str, str] | None,
        step: int | None,
        reward_wait_s: float,
        cold: bool,
    ) -> SyncRecord:
        record = future.result()
        for line in record.log_lines(self.bucket):
            log.info("%s", line)
        if cold and not self.replicas:  # followers only: rollouts begin once one serves it
            self._await_followers(record.version)
        path = record.delta_path or record.anchor_path
        outcomes = self._fanout.map(
            lambda name: self._sync_one(name, record.version, path, expected), self.replicas
        )
        results = {r.name: r for r in outcomes}
        paused = max((r.pause_s for r in results.values()), default=0.0)
        total = time.perf_counter() - started
        log.info(
            "Weight sync: done. Total %.1fs (inference paused %.1fs)%s",
            total,
            paused,
            ""
            if all(r.ok for r in results.values())
            else f"; lagging: {sorted(n for n, r in results.items() if not r.ok)}",
        )
        reward = self.rewards.reward(step, reward_wait_s) if self.rewards is not None else None
        complete = record.with_sync(
            tuple(results.values()), sync_s=total, step=step, reward_mean=reward
        )
        self._write_metrics(complete)
        self.records.append(complete)
        console.info("%s", version_line(complete))
        return complete

    def _await_followers(self, version: int, timeout_s: float = 1800) -> None:
        """At the cold start, block until a follower serves `version` (nothing can generate
        before); later versions reach the followers on their own."""
        deadline = time.monotonic() + timeout_s
        while max(self.state.synced.values(), default=0) < version:
            if time.monotonic() > deadline:
                raise DeltaSyncError(f"no follower served version {version} in {timeout_s:.0f} s")
            time.sleep(self._poll_s / 4)

    def _sync_one(
        self, name: str, version: int, path: str | None, expected: dict[str, str] | None
    ) -> ReplicaOutcome:
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
            return ReplicaOutcome(
                name,
                True,
                attempt,
                _seconds(timings.get("stage_s")),
                _seconds(timings.get("pause_s")),
                time.perf_counter() - started,
            )
        self.state.lagging.add(name)
        log.error(
            "replica %s is lagging at version %s; it catches up from the bucket next time",
            name,
            self.state.synced.get(name),
        )
        return ReplicaOutcome(
            name, False, self.attempts, total_s=time.perf_counter() - started, error=error
        )

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
