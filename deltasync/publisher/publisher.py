"""The trainer side: diff now, then encode -> upload -> commit the manifest in the background."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from deltasync.codec import encode_anchor, encode_delta, encode_virtual_anchor
from deltasync.codec.virtual import source_differences
from deltasync.defaults import ENCODING
from deltasync.errors import Fenced, FormatError, PublishError, StoreError
from deltasync.kernels.boxes import Box, box_sums
from deltasync.kernels.changes import Diff
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.detector import ChangeDetector
from deltasync.publisher.device_snapshot import DeviceSnapshot, detection_device
from deltasync.publisher.shards import ShardGroup, local_rows, part_info, replay_rows, to_global
from deltasync.publisher.snapshot import (
    Bf16Snapshot,
    NamedTensors,
    digests_after,
    named_tensors,
    state_after,
)
from deltasync.replica.replica import Replica
from deltasync.store import MissingFile, Store
from deltasync.wire.digests import StateDigest, bytes_digest, total
from deltasync.wire.fencing import RunOwner
from deltasync.wire.manifest import ChainEntry, Manifest, PartRef, file_path, metrics_path
from deltasync.wire.metadata import check_tiling, validate_run_id
from deltasync.wire.metrics import SyncRecord
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource

__all__ = ["Publisher", "PublisherConfig", "SyncRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    """Trainer-side settings; what readers must know travels in the files instead.

    Attributes:
        run_id: names the run in the bucket. A bucket holding another run is replaced by this
            one at its first commit; one holding this run is refused unless `takeover`.
        takeover: continue the run the bucket holds under `run_id` from its last committed
            version. The takeover is itself a commit (the same versions, the next epoch), so a
            publisher still writing the run fails its next commit (`Fenced`).
        encoding: delta encoding: `ctx` (default, about 0.7x of `ans`: coded per exponent
            group of the base element), `ans` (within 1 % of the context-free entropy floor,
            about 3x faster to code), `packed` (the encoding before `ans`) or `coo` (TRL v1
            interoperable).
        policy: when to write anchors and how many to keep.
        queue_size: versions that may wait for upload before `publish` blocks (back-pressure).
        write_metrics: write each version's metrics record after its commit. A caller that
            completes the record itself (the trainer adds replica outcomes and the reward)
            turns this off and writes it once, so every record has exactly one writer.
        source: the checkpoint the trainer started from (a Hub repo at a commit, or a folder).
            When a new run's first version equals its bf16 bytes, tensor by tensor, version 1
            is a virtual anchor naming it (a few KB) instead of a full upload.
        change_detection: where `publish` compares the weights with the last version: `host`
            (a bf16 copy of every parameter scanned on the CPU), `device` (against a bf16
            reference on the parameters' device, 2 bytes per parameter there, compared in
            bounded windows; only changed elements reach the host) or `auto` (device when the
            parameters are not on the CPU and that device's free memory holds the reference and
            a window's transient, else host). The choice is logged once, at the first publish.
    """

    run_id: str
    encoding: str = ENCODING
    policy: AnchorPolicy = field(default_factory=AnchorPolicy)
    queue_size: int = 2
    write_metrics: bool = True
    source: ModelSource | None = None
    change_detection: str = "auto"
    takeover: bool = False

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if self.change_detection not in ("host", "device", "auto"):
            raise ValueError(
                f"change_detection must be host, device or auto, got {self.change_detection!r}"
            )
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")


@dataclass(frozen=True)
class _Written:
    """What one publisher (one rank of a sharded run) wrote of a version, or its error."""

    version: int
    rows: dict[str, tuple[int, int]] | None = None  # sharded: this rank's rows
    delta: PartRef | None = None
    anchor: PartRef | None = None
    anchor_encoding: str = "full"
    changed: int = 0
    elements: int = 0
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # diff, encode, upload
    error: str | None = None

    def report(self, rank: int) -> dict[str, float | int]:
        return {
            "rank": rank,
            "bytes": sum(p.bytes for p in (self.delta, self.anchor) if p),
            "changed": self.changed,
            "elements": self.elements,
            "diff_s": self.seconds[0],
            "encode_s": self.seconds[1],
            "upload_s": self.seconds[2],
        }


@dataclass
class _Job:
    version: int
    diff: Diff | None  # None for the first version of a run: the snapshot itself is published
    future: Future[SyncRecord]
    diff_s: float
    enqueued_at: float
    uploaded: list[str] = field(default_factory=list)  # removed again if it is not committed
    settled: threading.Event = field(default_factory=threading.Event)  # worker done with it
    finish: Callable[[], Diff] | None = None  # the diff's second half (`start_diff`), not run yet

    def finished(self) -> Diff | None:
        """The diff, its second half run first if it has not been (under the publisher's lock:
        the worker and the next `publish` may both ask)."""
        if self.finish is not None:
            self.diff, self.finish = self.finish(), None
        return self.diff


class Publisher:
    """Publishes weight versions to a bucket without blocking the training loop on uploads.

    `publish` diffs the weights against the last committed snapshot plus the versions still in
    flight (so it must be called from one thread, and the tensors may change once it returns),
    then queues the upload. A background worker encodes, uploads with retries, commits the
    manifest, advances the snapshot and writes a metrics record (`write_metrics`); the version's
    future resolves then, and retention deletes the files the new manifest no longer names
    afterwards, before the worker takes the next version. If a version fails for good,
    it and every queued version are dropped, their futures fail, the next `publish` call raises
    the `PublishError`, and publishing then restarts from the last committed version.

    Sharded (`shards`, one publisher per trainer rank, FSDP2): each rank diffs only its own rows
    of every parameter and uploads them as its part of the version; the ranks then exchange
    their parts' names over `shards`, and rank 0 commits one manifest naming all of them once
    every part is durable. A version any rank failed is committed by none, and the failure is
    final for every rank (their later `publish` calls raise): the ranks' calls could no longer
    be paired version by version, so the job restarts and resumes from the bucket.

    Tensors are published under their checkpoint names and shapes (`names`; traced from the
    model when `publish` is given a module): a Mixture-of-Experts model's fused in-memory
    experts go out as the per-expert tensors its checkpoint holds.
    """

    def __init__(
        self,
        store: Store,
        config: PublisherConfig,
        *,
        shards: ShardGroup | None = None,
        names: CheckpointNames | None = None,
    ):
        self.store = store
        self.names = names
        self.config = config
        self._group = shards
        self.shards = shards if shards is not None and shards.size > 1 else None  # parts
        self._layout: dict[str, Box] | None = None  # sharded: this rank's rows
        self.last_parts: list[dict[str, float | int]] = []  # per rank (one unsharded), last version
        self._lock = threading.Lock()
        self._snapshot: ChangeDetector | None = None
        # the state resumed from the bucket, until the first publish chooses its detection
        self._resumed: Bf16Snapshot | None = None
        self._manifest: Manifest | None = None
        self._owner = RunOwner(store, config.run_id, takeover=config.takeover)
        self._claimed = False
        self._taken_over: Manifest | None = None  # the bucket's run of our id, to resume
        self._replayed: Replica | None = None  # a caller's replay of it (`resume_from`)
        self._sums: dict[str, StateDigest] | None = None  # per tensor, last committed version
        self._pending: list[_Job] = []
        self._last: _Job | None = None  # the newest version queued
        self._failure: PublishError | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.queue_size)
        self._worker: threading.Thread | None = None

    @property
    def committed_version(self) -> int | None:
        return None if self._manifest is None else self._manifest.latest_version

    def publish(self, source: NamedTensors) -> Future[SyncRecord]:
        """Queue the next version of `source`; blocks only while the queue is full.

        Raises:
            PublishError: an earlier version failed (raised once; publishing then resumes), a
                takeover found a file of the chain gone while it replayed the bucket, or the
                first version has no tensors.
        """
        if self._failure is not None:
            failure = self._failure
            if self.shards is None and not isinstance(failure, Fenced):
                self._failure = None
            raise failure
        started = time.perf_counter()
        source = self._local(source)
        if self._worker is None:
            self._start()
        with self._lock:
            finish = None  # the first version has no diff: the snapshot itself is published
            if self._snapshot is None:
                captured = Bf16Snapshot.capture(source)
                if not captured.tensors:
                    raise PublishError(
                        "the model has no tensors to publish (an empty state dict, or a module "
                        "whose parameters were not built yet)"
                    )
                self._snapshot = self._detector(captured, source)
            else:
                if self._resumed is not None:
                    self._snapshot = self._detector(self._resumed, source)
                pending = [d for j in self._pending if (d := j.finished()) is not None]
                inline = self.shards is None and self._snapshot.hashes_inline
                finish = self._snapshot.start_diff(source, pending, digests=inline)
            version = (self.committed_version or 0) + len(self._pending) + 1
            diff_s = time.perf_counter() - started  # what the training thread waited
            job = _Job(version, None, Future(), diff_s, time.time(), finish=finish)
            self._pending.append(job)
            self._last = job
        self._queue.put(job)
        return job.future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is committed (its retention deletes done) or failed.

        Raises:
            TimeoutError: `timeout` seconds passed first.
        """
        with self._lock:
            last = self._last
        # the worker takes versions in order: once the last is settled, every one is
        if last is not None and not last.settled.wait(timeout):
            raise TimeoutError(f"version {last.version} still in flight after {timeout} s")

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

    def _local(self, source: NamedTensors) -> NamedTensors:
        """The checkpoint tensors (`CheckpointNames`: given, or traced from a module on its
        first publish), and when sharded this rank's rows of each (the layout may not change);
        a group of one holds whole tensors, published as one file."""
        if self.names is None and isinstance(source, torch.nn.Module):
            self.names = CheckpointNames.of(source)
        if self._group is None:
            if self.names is None or self.names.is_identity:
                return source
            return self.names.apply(named_tensors(source))
        local, layout = local_rows(source, self.names)
        if self.shards is None:
            return local
        plain = sorted(n for n, b in layout.items() if not b.owner)
        if plain and len(plain) == len(layout):
            raise PublishError(
                "no parameter is sharded (DDP or one process holds everything): publish from "
                "rank 0 alone, with a Publisher built without `shards`"
            )
        if plain:
            raise PublishError(
                f"parameters {plain[:5]} are not sharded while others are: every rank would "
                "write all their rows (apply fully_shard to the root module as well)"
            )
        if self._layout is not None and layout != self._layout:
            moved = sorted(n for n in layout if layout[n] != self._layout.get(n))[:5]
            raise PublishError(f"the parameters' shards changed between versions: {moved}")
        self._layout = layout
        return local

    def _detector(self, host: Bf16Snapshot, source: NamedTensors) -> ChangeDetector:
        """The host snapshot, or a device reference beside it (`change_detection`), chosen once
        per snapshot: an `auto` that changed its mind with versions in flight could not rewind."""
        self._resumed = None
        device = detection_device(source, self.config.change_detection)
        return host if device is None else DeviceSnapshot(host, device)

    def claim(self) -> None:
        """Own the run in the bucket: a new run (replacing whatever run the bucket holds at
        its first commit), or with `takeover` the bucket's run of our id, fenced to this
        publisher at once (`deltasync.wire.fencing`). `publish` calls it first if the caller did
        not; calling it early turns a refusal into a one-line error before any training work
        (collective when sharded: every rank calls it, rank 0 decides).

        Raises:
            PublishError: the bucket already holds this run and `takeover` is off, or the
                takeover lost a race with another publisher.
        """
        if self._claimed:
            return
        decide = self.shards is None or self.shards.rank == 0
        try:
            found, refusal = self._owner.claim(decide=decide), None
        except PublishError as exc:
            found, refusal = None, str(exc)
        if self.shards is not None:
            refusal = self.shards.broadcast(refusal)
        if refusal is not None:
            raise PublishError(refusal)
        self._claimed, self._taken_over = True, found

    def resume_from(self, replica: Replica) -> None:
        """Resume a taken-over run from `replica`, which already holds a version of it synced
        from the bucket (the trainer replays it to load its weights): only versions committed
        since are fetched, not the whole chain a second time (a replica without the state's
        digests replays from scratch). Call before the first `publish`."""
        if self._worker is not None:
            raise RuntimeError("resume_from must come before the first publish")
        self._replayed = replica

    def _start(self) -> None:
        """Claim the run, resume a taken-over one from the bucket, start the worker."""
        self.claim()
        manifest = self._taken_over
        if manifest is not None:
            try:
                self._resumed, self._sums = self._resume(manifest)
                self._snapshot = self._resumed
            except MissingFile as exc:  # retention of a newer owner, racing this takeover
                raise PublishError(
                    f"run {manifest.run_id}: {exc.path} vanished while this publisher replayed "
                    "the bucket to resume it (another publisher moved the run on, or the file "
                    "was deleted); take the run over again to continue from the bucket"
                ) from None
            self._manifest = manifest
            log.info(
                "resuming run %s at version %d (epoch %d)",
                manifest.run_id,
                manifest.latest_version,
                self._owner.epoch,
            )
        self._worker = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._worker.start()

    def _resume(self, manifest: Manifest) -> tuple[Bf16Snapshot, dict[str, StateDigest]]:
        """The committed state to diff against: a sharded rank replays its own parts when the
        run was written by ranks of its layout, else the whole model once and keeps its rows."""
        layout, shards = self._layout, self.shards
        if layout is not None and shards is not None:
            found = replay_rows(self.store, manifest, layout, shards.rank, shards.size)
            if found is not None:
                log.info("rank %d replayed its rows from its own parts", shards.rank)
                return Bf16Snapshot(found[0]), found[1]
            log.info("rank %d replays the whole model (the run has another layout)", shards.rank)
        replica, self._replayed = self._replayed, None
        if replica is None or replica.state_digest is None:  # none, or one that cannot vouch
            replica = Replica()
        replica.sync(self.store)  # from what it holds: nothing to fetch when it is current
        tensors, sums = dict(replica.tensors), dict(replica.state_sums)
        if layout is not None:
            shapes = {n: tuple(t.shape) for n, t in tensors.items()}
            if shapes != {n: s.shape for n, s in layout.items()}:
                raise PublishError(
                    f"run {manifest.run_id} in the bucket holds other parameters than this "
                    "rank's model; resume it with the model it was published from"
                )
            tensors = {n: b.take(tensors[n]).clone() for n, b in layout.items()}
            sums = box_sums(tensors, layout)
        return Bf16Snapshot(tensors), sums

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if not job.future.done():  # else dropped because an earlier version failed
                    self._run_one(job)
            finally:
                job.settled.set()

    def _run_one(self, job: _Job) -> None:
        """One version: processed, its future resolved (replicas may be told at once), then
        its retention deletes, which only log their failures: the version is committed."""
        try:
            record, retired = self._process(job)
        except Exception as exc:
            self._fail(job, exc)
            return
        job.future.set_result(record)
        try:
            self._owner.retire(retired, job.version)
        except Exception:  # a bug here must not stop the worker, nor touch the committed version
            log.exception(
                "retention after version %d failed; its files are left for gc", job.version
            )

    def _fail(self, job: _Job, exc: Exception) -> None:
        if isinstance(exc, Fenced):
            error: PublishError = exc
        else:
            error = PublishError(
                f"version {job.version} was not published: {exc}", version=job.version
            )
            error.__cause__ = exc
        log.error("%s", error)
        self._owner.remove_uncommitted(job.uploaded, job.version)
        with self._lock:
            dropped, self._pending = self._pending, []
            if self._manifest is None:
                self._snapshot, self._sums = None, None
            self._failure = error
        for other in dropped:  # queued jobs are skipped by the worker once their future is done
            if not other.future.done():
                other.future.set_exception(error)

    def _process(self, job: _Job) -> tuple[SyncRecord, list[str]]:
        """Write this publisher's files of the version, agree with the other ranks (when
        sharded), commit, then record; returns the record and the files retention retires
        (rank 0 only). Unsharded, the publisher is a group of one."""
        queued_s = time.time() - job.enqueued_at
        try:
            mine, sums = self._write(job)
        except Exception as exc:  # sharded: reported to every rank, so that none commits it
            if self.shards is None:
                raise
            log.error("rank %d: version %d: %s", self.shards.rank, job.version, exc)
            mine, sums = _Written(job.version, error=f"rank {self.shards.rank}: {exc}"), None
        written = self._agree(job, mine)
        deltas = [w.delta for w in written if w.delta]
        anchors = [w.anchor for w in written if w.anchor]
        entries = []
        if deltas:
            changed = sum(w.changed for w in written)
            entries.append(self._entry(job.version, "delta", self.config.encoding, deltas, changed))
        if anchors:
            elements = sum(w.elements for w in written)
            entries.append(
                self._entry(job.version, "anchor", mine.anchor_encoding, anchors, elements)
            )
        previous = self._manifest
        manifest = self._commit_agreed(entries, job.version)
        with self._lock:
            if job.diff is not None:
                self._snapshot.advance(job.diff)  # type: ignore[union-attr]
            self._sums = sums
            self._manifest = manifest
            self._pending.remove(job)
        self.last_parts = [w.report(rank) for rank, w in enumerate(written)]
        record = _record(self.config, job, written, entries, manifest, queued_s)
        if self.shards is not None and self.shards.rank != 0:
            return record, []
        if self.config.write_metrics:
            self._write_record(record)
        uploaded = {p.path for w in written for p in (w.delta, w.anchor) if p}
        return record, _retired(previous, manifest, uploaded)

    def _write(self, job: _Job) -> tuple[_Written, dict[str, StateDigest]]:
        """Encode and upload this publisher's delta of the version (its rows of it when
        sharded) and, by policy, its anchor."""
        with self._lock:  # the changes reach the host here, off the training thread
            job.finished()
        cfg, snapshot, layout = self.config, self._snapshot, self._layout
        assert snapshot is not None
        part = None
        if self.shards is not None and layout is not None:
            part = part_info(self.shards.rank, self.shards.size, layout)
        t0 = time.perf_counter()
        diff = job.diff if job.diff is None or layout is None else to_global(job.diff, layout)
        if diff is None or self._sums is None:  # the first version: a full pass, once
            state = state_after(snapshot.tensors, job.diff)
            sums = state_sums(state) if layout is None else box_sums(state, layout)
        else:  # the worker runs versions in order, so `_sums` is the base's
            sums = apply_changes(self._sums, diff.changes)
        digest = total(sums)
        if self.shards is None and job.diff is not None and not job.diff.digests:
            job.diff = replace(job.diff, digests=digests_after(snapshot.tensors, job.diff))
            diff = job.diff  # the device mode's diffs: per-tensor digests from the mirror
        encode_s, upload_s = time.perf_counter() - t0, 0.0
        delta = anchor = None
        anchor_encoding = "full"
        if diff is not None:
            t0 = time.perf_counter()
            data = encode_delta(
                diff,
                run_id=cfg.run_id,
                version=job.version,
                base_version=job.version - 1,
                state_digest=digest,
                encoding=cfg.encoding,
                part=part,
                base=snapshot.tensors,  # the base version's (host mirror)
            )
            t1 = time.perf_counter()
            delta = self._put(job, data, "delta", digest)
            encode_s, upload_s = encode_s + t1 - t0, upload_s + time.perf_counter() - t1
        if job.diff is None or cfg.policy.wants_anchor(self._manifest, job.version):
            t0 = time.perf_counter()
            state = state_after(snapshot.tensors, job.diff)
            first = self.shards is None and self._manifest is None and job.diff is None
            if first and self._matches_source(state):
                assert cfg.source is not None
                anchor_encoding = "virtual"
                data = encode_virtual_anchor(
                    state, cfg.source, run_id=cfg.run_id, version=job.version, state_digest=digest
                )
            else:
                data = encode_anchor(
                    state,
                    run_id=cfg.run_id,
                    version=job.version,
                    digests=None if job.diff is None or part is not None else job.diff.digests,
                    state_digest=digest,
                    part=part,
                    shapes=None if layout is None else {n: s.shape for n, s in layout.items()},
                )
            t1 = time.perf_counter()
            anchor = self._put(job, data, "anchor", digest)
            encode_s, upload_s = encode_s + t1 - t0, upload_s + time.perf_counter() - t1
        elements = sum(t.numel() for t in snapshot.tensors.values())
        changed = elements if job.diff is None else job.diff.changed_elements
        rows, seconds = None if part is None else part.rows, (job.diff_s, encode_s, upload_s)
        return _Written(
            job.version, rows, delta, anchor, anchor_encoding, changed, elements, seconds
        ), sums

    def _put(self, job: _Job, data: bytes, kind: str, digest: StateDigest) -> PartRef:
        hashed = bytes_digest(data)
        part = None if self.shards is None else (self.shards.rank, self.shards.size)
        path = file_path(self.config.run_id, kind, job.version, hashed, part)
        job.uploaded.append(path)  # before the put: a put that fails midway may leave bytes
        self.store.put(path, data)
        return PartRef(path, len(data), hashed, digest.hex())

    def _agree(self, job: _Job, mine: _Written) -> list[_Written]:
        """Every rank's files of the version, once all wrote theirs and their rows tile."""
        if self.shards is None:
            return [mine]
        written: list[_Written] = self.shards.all_gather(mine)
        errors = [w.error for w in written if w.error]
        if len({w.version for w in written}) > 1:
            errors.append(f"ranks are at versions {[w.version for w in written]}")
        if not errors:  # every reader would refuse parts whose rows do not tile: commit none
            try:
                check_tiling(
                    {n: s.shape for n, s in (self._layout or {}).items()},
                    [w.rows or {} for w in written],
                )
            except FormatError as exc:
                errors.append(f"the ranks' rows do not fit together: {exc}")
        if errors:
            raise PublishError("; ".join(errors), version=job.version)
        return written

    def _entry(
        self, version: int, kind: str, encoding: str, files: list[PartRef], count: int
    ) -> ChainEntry:
        """The manifest entry of the version's delta or anchor: its one file, or every rank's
        part, their bytes and digests summed."""
        if self.shards is None:
            (file,) = files
            return ChainEntry(
                version, kind, file.path, file.bytes, file.digest, encoding, count,
                file.state_digest,
            )  # fmt: skip
        digest = sum((StateDigest.parse(f.state_digest) for f in files), StateDigest.zero())
        size = sum(f.bytes for f in files)
        return ChainEntry(
            version, kind, None, size, None, encoding, count, digest.hex(), tuple(files)
        )  # type: ignore[arg-type]

    def _matches_source(self, state: dict[str, torch.Tensor]) -> bool:
        """Whether the first version can name `config.source` instead of carrying weights."""
        source = self.config.source
        if source is None:
            return False
        differ = source_differences(source, state)
        if differ:
            log.warning(
                "version 1 is a full anchor: %d tensors differ from the checkpoint %s (%s)",
                len(differ),
                source,
                ", ".join(differ[:3]),
            )
            return False
        log.info("version 1 names the checkpoint %s instead of uploading the weights", source)
        return True

    def _commit_agreed(self, entries: list[ChainEntry], version: int) -> Manifest:
        """Commit the version: here when unsharded; sharded, rank 0 commits and tells the
        others the manifest it wrote (or why it could not)."""
        if self.shards is None:
            return self._commit(entries, version)
        committed: tuple[str, str] | None = None
        if self.shards.rank == 0:
            try:
                committed = ("ok", self._commit(entries, version).to_json().decode())
            except Exception as exc:
                committed = ("error", f"rank 0 could not commit the manifest: {exc}")
        status, text = self.shards.broadcast(committed)
        if status != "ok":
            raise PublishError(text, version=version)
        return Manifest.from_json(text.encode())

    def _commit(self, entries: list[ChainEntry], version: int) -> Manifest:
        """Write the manifest that makes the version visible: the commit point, a
        compare-and-swap against the manifest this publisher last read or wrote.

        Raises:
            Fenced: the bucket's manifest is no longer ours (a takeover or another run).
        """
        if self._manifest is None:
            anchor = entries[-1]
            manifest = Manifest(self.config.run_id, anchor.version, (anchor,), (), anchor.bytes)
        else:
            manifest = self._manifest.with_version(entries, self.config.policy.keep_anchors)
        return self._owner.commit(manifest, version)

    def _write_record(self, record: SyncRecord) -> None:
        """The version's metrics record, after its commit; a failure is logged only (the
        version is committed already)."""
        try:
            self.store.put(metrics_path(record.run_id, record.version), record.to_json())
        except StoreError as exc:
            log.warning("metrics record for version %d not written: %s", record.version, exc)


def _retired(previous: Manifest | None, manifest: Manifest, uploaded: set[str]) -> list[str]:
    """The files retention deletes once `manifest` replaced `previous`: those it no longer
    names, and this version's own upload when retention already drops it (keep_anchors=1 and
    an anchor at this version: no manifest ever names it, so nothing else would delete it).
    Nothing after another run's manifest (its files are `gc`'s)."""
    if previous is None or previous.run_id != manifest.run_id:
        return []
    return sorted((previous.referenced_paths() | uploaded) - manifest.referenced_paths())


def _record(
    config: PublisherConfig,
    job: _Job,
    written: list[_Written],
    entries: list[ChainEntry],
    manifest: Manifest,
    queued_s: float,
) -> SyncRecord:
    """The version's metrics record; a sharded version names its first part's files."""
    deltas = [w.delta for w in written if w.delta]
    anchors = [w.anchor for w in written if w.anchor]
    elements = sum(w.elements for w in written)
    changed = elements if job.diff is None else sum(w.changed for w in written)
    diff_s, encode_s, upload_s = (max(w.seconds[i] for w in written) for i in range(3))
    return SyncRecord(
        run_id=config.run_id,
        version=job.version,
        kind="+".join(e.kind for e in entries),
        encoding=config.encoding,
        delta_path=deltas[0].path if deltas else None,
        anchor_path=anchors[0].path if anchors else None,
        delta_bytes=sum(p.bytes for p in deltas),
        anchor_bytes=sum(p.bytes for p in anchors),
        full_bytes=2 * elements,
        changed_elements=changed,
        total_elements=elements,
        sparsity=1.0 - changed / elements if elements else 1.0,
        diff_s=max(diff_s, job.diff_s),
        encode_s=encode_s,
        upload_s=upload_s,
        queued_s=queued_s,
        committed_at=manifest.updated_at,
    )
