"""The trainer side: diff now, then encode -> upload -> commit the manifest in the background."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .changes import Diff, scatter
from .codec import encode_anchor, encode_delta
from .codec.metadata import validate_run_id
from .digest import bytes_digest
from .errors import PublishError, StoreError
from .manifest import MANIFEST_PATH, ChainEntry, Manifest, file_path, metrics_path, read_manifest
from .metrics import SyncRecord
from .policy import AnchorPolicy
from .replica import Replica
from .snapshot import Bf16Snapshot, NamedTensors
from .state_digest import StateDigest, total
from .state_hash import apply_changes, state_sums
from .store import Store

__all__ = ["Publisher", "PublisherConfig", "SyncRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    """Trainer-side settings; what readers must know travels in the files instead.

    Attributes:
        run_id: names the run in the bucket; a bucket whose manifest has this run is resumed.
        encoding: delta encoding, `packed` (default) or `coo` (TRL v1 interoperable).
        policy: when to write anchors and how many to keep.
        queue_size: versions that may wait for upload before `publish` blocks (back-pressure).
        write_metrics: write each version's metrics record after its commit. A caller that
            completes the record itself (the trainer adds replica outcomes and the reward)
            turns this off and writes it once, so every record has exactly one writer.
    """

    run_id: str
    encoding: str = "packed"
    policy: AnchorPolicy = field(default_factory=AnchorPolicy)
    queue_size: int = 2
    write_metrics: bool = True

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")


@dataclass
class _Job:
    version: int
    diff: Diff | None  # None for the first version of a run: the snapshot itself is published
    future: Future[SyncRecord]
    diff_s: float
    enqueued_at: float


class Publisher:
    """Publishes weight versions to a bucket without blocking the training loop on uploads.

    `publish` diffs the weights against the last committed snapshot plus the versions still in
    flight (so it must be called from one thread, and the tensors may change once it returns),
    then queues the upload. A background worker encodes, uploads with retries, commits the
    manifest, advances the snapshot and writes a metrics record. If a version fails for good,
    it and every queued version are dropped, their futures fail, the next `publish` call raises
    the `PublishError`, and publishing then restarts from the last committed version.
    """

    def __init__(self, store: Store, config: PublisherConfig):
        self.store = store
        self.config = config
        self._lock = threading.Lock()
        self._snapshot: Bf16Snapshot | None = None
        self._manifest: Manifest | None = None
        self._sums: dict[str, StateDigest] | None = None  # per tensor, last committed version
        self._pending: list[_Job] = []
        self._failure: PublishError | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.queue_size)
        self._worker: threading.Thread | None = None

    @property
    def committed_version(self) -> int | None:
        return None if self._manifest is None else self._manifest.latest_version

    def publish(self, source: NamedTensors) -> Future[SyncRecord]:
        """Queue the next version of `source`; blocks only while the queue is full.

        Raises:
            PublishError: an earlier version failed (raised once; publishing then resumes).
        """
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._worker is None:
            self._start()
        started = time.perf_counter()
        with self._lock:
            if self._snapshot is None:
                self._snapshot, diff = Bf16Snapshot.capture(source), None
            else:
                diff = self._snapshot.diff(source, [j.diff for j in self._pending if j.diff])
            version = (self.committed_version or 0) + len(self._pending) + 1
            job = _Job(version, diff, Future(), time.perf_counter() - started, time.time())
            self._pending.append(job)
        self._queue.put(job)
        return job.future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is committed or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            futures = [j.future for j in self._pending]
        for future in futures:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            future.exception(timeout=remaining)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued work, then stop the worker."""
        if self._worker is not None:
            self.flush(timeout)
            self._queue.put(None)
            self._worker.join(timeout)
            self._worker = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        """Resume the run in the bucket when its manifest names our run id."""
        manifest = read_manifest(self.store)
        if manifest is not None and manifest.run_id == self.config.run_id:
            replica = Replica()
            replica.sync(self.store)
            self._snapshot = Bf16Snapshot(replica.tensors)
            self._sums = dict(replica.state_sums)
            self._manifest = manifest
            log.info("resuming run %s at version %d", manifest.run_id, manifest.latest_version)
        self._worker = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.future.done():  # dropped because an earlier version failed
                continue
            try:
                record = self._process(job)
            except Exception as exc:
                self._fail(job, exc)
            else:
                job.future.set_result(record)

    def _fail(self, job: _Job, exc: Exception) -> None:
        error = PublishError(f"version {job.version} was not published: {exc}", version=job.version)
        error.__cause__ = exc
        log.error("%s", error)
        with self._lock:
            dropped, self._pending = self._pending, []
            if self._manifest is None:
                self._snapshot, self._sums = None, None
            self._failure = error
        for other in dropped:  # queued jobs are skipped by the worker once their future is done
            if not other.future.done():
                other.future.set_exception(error)

    def _process(self, job: _Job) -> SyncRecord:
        cfg, snapshot = self.config, self._snapshot
        assert snapshot is not None
        queued_s = time.time() - job.enqueued_at
        entries: list[ChainEntry] = []
        encode_s = upload_s = 0.0
        delta_entry = anchor_entry = None
        t0 = time.perf_counter()
        if job.diff is None or self._sums is None:  # the first version: a full pass, once
            sums = state_sums(_state_after(snapshot, job.diff))
        else:  # the worker runs versions in order, so `_sums` is the base's
            sums = apply_changes(self._sums, job.diff.changes)
        state_digest = total(sums)
        digest_s = time.perf_counter() - t0
        if job.diff is not None:
            t0 = time.perf_counter()
            data = encode_delta(
                job.diff,
                run_id=cfg.run_id,
                version=job.version,
                base_version=job.version - 1,
                state_digest=state_digest,
                encoding=cfg.encoding,
            )
            t1 = time.perf_counter()
            delta_entry = self._upload(
                data, "delta", job.version, cfg.encoding, job.diff.changed_elements, state_digest
            )
            encode_s, upload_s = t1 - t0, time.perf_counter() - t1
            entries.append(delta_entry)
        if job.diff is None or cfg.policy.wants_anchor(self._manifest, job.version):
            t0 = time.perf_counter()
            data = encode_anchor(
                _state_after(snapshot, job.diff),
                run_id=cfg.run_id,
                version=job.version,
                digests=None if job.diff is None else job.diff.digests,
                state_digest=state_digest,
            )
            t1 = time.perf_counter()
            elements = sum(t.numel() for t in snapshot.tensors.values())
            anchor_entry = self._upload(data, "anchor", job.version, "full", elements, state_digest)
            encode_s, upload_s = encode_s + t1 - t0, upload_s + time.perf_counter() - t1
            entries.append(anchor_entry)
        previous = self._manifest
        manifest = self._commit(entries)
        with self._lock:
            if job.diff is not None:
                snapshot.advance(job.diff)
            self._sums = sums
            self._manifest = manifest
            self._pending.remove(job)
        elements = sum(t.numel() for t in snapshot.tensors.values())
        changed = elements if job.diff is None else job.diff.changed_elements
        record = SyncRecord(
            run_id=cfg.run_id,
            version=job.version,
            kind="+".join(e.kind for e in entries),
            encoding=cfg.encoding,
            delta_path=delta_entry and delta_entry.path,
            anchor_path=anchor_entry and anchor_entry.path,
            delta_bytes=delta_entry.bytes if delta_entry else 0,
            anchor_bytes=anchor_entry.bytes if anchor_entry else 0,
            full_bytes=2 * elements,
            changed_elements=changed,
            total_elements=elements,
            sparsity=1.0 - changed / elements if elements else 1.0,
            diff_s=job.diff_s,
            encode_s=encode_s + digest_s,
            upload_s=upload_s,
            queued_s=queued_s,
            committed_at=manifest.updated_at,
        )
        self._after_commit(record, previous, manifest)
        return record

    def _upload(
        self,
        data: bytes,
        kind: str,
        version: int,
        encoding: str,
        changed: int,
        state_digest: StateDigest,
    ) -> ChainEntry:
        digest = bytes_digest(data)
        path = file_path(self.config.run_id, kind, version, digest)
        self.store.put(path, data)
        return ChainEntry(
            version,
            kind,
            path,
            len(data),
            digest,
            encoding,
            changed,
            state_digest.hex(),  # type: ignore[arg-type]
        )

    def _commit(self, entries: list[ChainEntry]) -> Manifest:
        """Write the manifest that makes the version visible: the commit point."""
        if self._manifest is None:
            anchor = entries[-1]
            manifest = Manifest(self.config.run_id, anchor.version, (anchor,), (), anchor.bytes)
        else:
            manifest = self._manifest.with_version(entries, self.config.policy.keep_anchors)
        data = manifest.to_json()
        self.store.publish(MANIFEST_PATH, data)
        return manifest

    def _after_commit(
        self, record: SyncRecord, previous: Manifest | None, manifest: Manifest
    ) -> None:
        """Metrics record (unless the caller writes it), then retention: files the new manifest
        no longer names are deleted.

        Failures here are logged only: the version is committed already.
        """
        if self.config.write_metrics:
            try:
                self.store.put(metrics_path(record.run_id, record.version), record.to_json())
            except StoreError as exc:
                log.warning("metrics record for version %d not written: %s", record.version, exc)
        if previous is None or previous.run_id != manifest.run_id:
            return
        # Also this version's own delta when retention already drops it (keep_anchors=1 and an
        # anchor at this version): no manifest ever names it, so nothing else would delete it.
        uploaded = {p for p in (record.delta_path, record.anchor_path) if p}
        for path in sorted((previous.referenced_paths() | uploaded) - manifest.referenced_paths()):
            try:
                self.store.delete(path)
            except StoreError as exc:
                log.warning("retention could not delete %s: %s", path, exc)


def _state_after(snapshot: Bf16Snapshot, diff: Diff | None) -> dict[str, torch.Tensor]:
    """The full bf16 state once `diff` is applied, copying only the tensors it touches."""
    state = dict(snapshot.tensors)
    for name, change in (diff.changes if diff else {}).items():
        patched = state[name].clone()
        scatter(patched, change.indices, change.values)
        state[name] = patched
    return state
