"""TRL `weight_transfer=` backend: publish through the bucket, then drive every rollout replica.

TRL calls `pause()`, `send_weights(iterator)`, `resume()` after each optimizer step. Here `pause`
and `resume` are no-ops: `send_weights` only diffs the live weights (bitwise, against the last
published bf16 snapshot) and hands the version to the background. A sync thread then waits for
the commit and, for every replica in parallel, stages the file while it serves, pauses it, applies
and verifies, and resumes it. A replica counts as synced at version v only once it reports v.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass, field

import torch

from deltasync import Publisher, SyncRecord
from deltasync.digest import tensor_digest
from deltasync.errors import DeltaSyncError
from deltasync.manifest import metrics_path
from deltasync.snapshot import bf16_view
from deltasync.vllm_ext.client import ReplicaClient

__all__ = ["BucketWeightTransfer", "ReplicaSync"]

log = logging.getLogger("trainer.weight_sync")


@dataclass
class ReplicaSync:
    """One replica's outcome for one version (written into the metrics record)."""

    ok: bool
    attempts: int
    stage_s: float = 0.0
    pause_s: float = 0.0
    total_s: float = 0.0
    error: str | None = None


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
            with the trainer's bf16 view (a full hash pass on both sides; for tests and audits).
    """

    def __init__(
        self,
        publisher: Publisher,
        replicas: dict[str, ReplicaClient],
        *,
        bucket: str,
        attempts: int = 2,
        verify_digests: bool = False,
    ):
        self.publisher = publisher
        self.replicas = replicas
        self.bucket = bucket
        self.attempts = attempts
        self.verify_digests = verify_digests
        self.state = _State()
        self.reward_mean: float | None = None
        self.step: int | None = None
        self.records: list[dict] = []
        self._order = ThreadPoolExecutor(1, thread_name_prefix="deltasync-sync")
        self._fanout = ThreadPoolExecutor(max(1, len(replicas)), thread_name_prefix="replica")
        self._pending: list[Future[dict]] = []
        self._lock = threading.Lock()

    def init_weight_transfer(self) -> None:
        """Wait until every replica answers, and point it at the bucket."""
        for name, client in self.replicas.items():
            deadline = time.monotonic() + 300
            while not client.healthy():
                if time.monotonic() > deadline:
                    raise DeltaSyncError(f"rollout server {name} did not become healthy in 300 s")
                time.sleep(1)
            client.init(self.bucket)

    def pause(self) -> None:
        """Nothing to do: replicas keep serving while the version uploads and stages."""

    def resume(self) -> None:
        """Nothing to do: each replica is paused only around its own apply."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Diff now (TRL's tensors are live views), upload and sync replicas in the background."""
        started = time.perf_counter()
        named = _materialise(iterator)
        future = self.publisher.publish(named)
        expected = (
            {n: tensor_digest(bf16_view(t)) for n, t in named} if self.verify_digests else None
        )
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            sync = self._order.submit(self._finish, future, started, expected)
            sync.add_done_callback(_log_failure)
            self._pending.append(sync)
        if not self.state.synced:  # cold start: rollouts begin once a replica serves a version
            sync.result(timeout=1800)

    def destroy(self) -> None:
        """Let queued syncs finish (bounded), then stop the publisher."""
        with self._lock:
            pending = list(self._pending)
        futures_wait(pending, timeout=600)  # never raises; failures were logged by _log_failure
        self.publisher.close(timeout=600)
        self._order.shutdown(wait=True)
        self._fanout.shutdown(wait=True)

    def wait(self, timeout: float = 600) -> list[dict]:
        """Block until every sync handed over so far has finished; returns their records."""
        with self._lock:
            pending = list(self._pending)
        return [f.result(timeout=timeout) for f in pending]

    def _finish(
        self, future: Future[SyncRecord], started: float, expected: dict[str, str] | None
    ) -> dict:
        record = future.result()
        for line in record.log_lines(self.bucket):
            log.info("%s", line)
        path = record.delta_path or record.anchor_path
        outcomes = self._fanout.map(
            lambda name: self._sync_one(name, record.version, path, expected), self.replicas
        )
        results = dict(zip(self.replicas, outcomes, strict=True))
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
        entry = asdict(record) | {
            "replicas": {n: asdict(r) for n, r in results.items()},
            "sync_s": total,
            "reward_mean": self.reward_mean,
            "step": self.step,
        }
        self._write_metrics(record, entry)
        self.records.append(entry)
        return entry

    def _sync_one(
        self, name: str, version: int, path: str | None, expected: dict[str, str] | None
    ) -> ReplicaSync:
        client = self.replicas[name]
        started = time.perf_counter()
        error = None
        for attempt in range(1, self.attempts + 1):
            try:
                timings = client.sync_to(version, path)
                served = int(client.weight_version())
                if served != version:
                    raise DeltaSyncError(f"replica reports version {served}, expected {version}")
                if expected is not None:
                    _check_digests(client.digests()["digests"], expected)
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
            self.state.synced[name] = version
            self.state.lagging.discard(name)
            return ReplicaSync(
                True, attempt, timings["stage_s"], timings["pause_s"], time.perf_counter() - started
            )
        self.state.lagging.add(name)
        log.error(
            "replica %s is lagging at version %s; it catches up from the bucket next time",
            name,
            self.state.synced.get(name),
        )
        return ReplicaSync(False, self.attempts, total_s=time.perf_counter() - started, error=error)

    def _write_metrics(self, record: SyncRecord, entry: dict) -> None:
        """Extend the publisher's metrics record with replica timings and the reward."""
        try:
            self.publisher.store.put(
                metrics_path(record.run_id, record.version), json.dumps(entry).encode()
            )
        except DeltaSyncError as exc:
            log.warning("metrics record for version %d not updated: %s", record.version, exc)


def _log_failure(sync: Future[dict]) -> None:
    """A sync that raised loses its replica outcomes: say so when it happens."""
    if not sync.cancelled() and sync.exception() is not None:
        log.error("weight sync failed", exc_info=sync.exception())


def _check_digests(served: dict[str, str], expected: dict[str, str]) -> None:
    """The replica serves exactly the trainer's bf16 bytes (tied aliases appear under one name)."""
    wrong = sorted(n for n, d in expected.items() if served.get(n) != d)
    if wrong:
        raise DeltaSyncError(f"served weights differ from the trainer's in {wrong[:5]}")


def _materialise(iterator: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """TRL yields live parameter views; the publisher diffs them before returning."""
    return list(iterator)
