"""The reader side: one state machine for every apply path; where the bytes go is a `Sink`.

`Replica` owns every rule of the chain (run and base checks, stale anchors, the model's tensor
set, TRL v1 files, digest verification, the running full-state digest) and the split between
`stage` (decode, validate and verify while the model serves; nothing is mutated) and `commit`
(the pause: the sink writes, all or nothing); the third step is the periodic **recompute** of
the full-state digest from the held bytes. Sinks only hold bytes (`replica.sinks`); a file is
decoded and verified against the sink's state with the files staged before it applied
(`replica.staged_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deltasync import defaults
from deltasync.codec import DecodedFile, FileMetadata, ParsedFile, ParsedParts, decode
from deltasync.codec.virtual import SourcePolicy
from deltasync.errors import ChainError, DigestMismatch, FormatError
from deltasync.kernels.boxes import Boxes, box_change_sums, box_sums
from deltasync.kernels.changes import WORKERS, TensorChange, scatter
from deltasync.kernels.state_hash import apply_changes, change_sum, state_sums
from deltasync.replica.driven import plan_sync
from deltasync.replica.replay import bounded_by, replay
from deltasync.replica.sinks import DictSink, Shapes, Sink, StagedFile
from deltasync.replica.staged_state import StagedState, staged_state
from deltasync.store import Store
from deltasync.wire.digests import StateDigest, tensor_digest, total
from deltasync.wire.manifest import FileData
from deltasync.wire.stored import StoredFile

__all__ = ["Replica", "StagedUpdate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedUpdate:
    """The verified files that lead from `base` to the next version, and the sink's preparation.

    Empty `files` means there is nothing to do (every file was a version already held).
    `sums` are the per-tensor full-state digests after the update (None when not verifying) and
    `since_recompute` the versions they have been moved in O(changed) since a full pass. A sink
    holding boxes (`Sink.boxes`) sums only its share: `partials` then holds that share of the
    state after each file, which `Replica.commit` needs combined with the other workers'.
    """

    base: tuple[str | None, int | None]
    files: tuple[StagedFile, ...]
    sink_state: Any = None
    sums: Mapping[str, StateDigest] | None = None
    since_recompute: int = 0
    partials: tuple[StateDigest, ...] = ()

    @property
    def versions(self) -> list[int]:
        return [f.meta.version for f in self.files]


class Replica:
    """A copy of the served weights at a known (run, version), written through a `Sink`.

    Invariants: a delta applies only on its exact base version of the same run; an anchor never
    moves a replica back within its run; anything malformed, or whose digests do not match,
    raises in `stage` before the sink is touched; `commit` is all or nothing.

    The full-state digest (`deltasync.wire.digests`): the replica keeps one per tensor, computed
    over the whole state at every anchor (bootstrap included), moved in O(changed) by each delta
    from the old and new values of its changed elements, and compared with every file's. That
    O(changed) update cannot see an element that changed in memory without a delta; the full
    recompute every `recompute_every` versions can: it refuses the next update naming the
    tensor, and the replica forgets its version so that the next update reloads an anchor.

    Args:
        sink: where the tensors live (default: a `DictSink`).
        allow_legacy: accept TRL v1 files, which carry no run, base version or digests (their
            base is assumed to be the version held, and nothing can be verified).
        verify: check every file before committing: the full-state digest, and the per-tensor
            digests of an anchor's tensors (of a protocol 1 delta's touched tensors, which
            carries no full-state digest).
        recompute_every: recompute the full-state digest over the held state (while serving)
            before the first delta applied this many versions after the last full pass; 0: only
            at anchors.
        sources: where a virtual anchor's checkpoint may be read from (a served replica: its
            own model's, `SourcePolicy.for_model`); None: anywhere (the CLI, tests).
    """

    def __init__(
        self,
        sink: Sink | None = None,
        *,
        allow_legacy: bool = False,
        verify: bool = True,
        recompute_every: int = defaults.RECOMPUTE_EVERY,
        sources: SourcePolicy | None = None,
    ):
        if recompute_every < 0:
            raise ValueError(f"recompute_every must be >= 0, got {recompute_every}")
        self.sink: Sink = sink if sink is not None else DictSink()
        self.allow_legacy = allow_legacy
        self.verify = verify
        self.recompute_every = recompute_every
        self.sources = sources
        self.run_id: str | None = None
        self.version: int | None = None
        self._sums: Mapping[str, StateDigest] | None = None
        self._digest: StateDigest | None = None
        self._since_recompute = 0

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self.sink.tensors()

    @property
    def state_sums(self) -> Mapping[str, StateDigest]:
        """Per-tensor full-state digests of the held version (empty when none is held)."""
        return self._sums or {}

    @property
    def state_digest(self) -> StateDigest | None:
        """The full-state digest of the held version (as its files promised), if one is held;
        for a sink holding boxes, the one all workers' shares combined to."""
        return None if self._sums is None else self._digest

    def stage(self, files: Sequence[tuple[FileData, str | None]]) -> StagedUpdate:
        """Decode, check and verify `files` (data, path) in order, each against the state the
        previous ones lead to; then let the sink stage them. Nothing is mutated; raises on any
        problem (`FormatError`, `ChainError`, `DigestMismatch`). The one exception: held bytes
        found changed without a delta make the replica forget its version (see `_recompute`)."""
        base = (self.run_id, self.version)
        run_id, version = base
        shapes = self.sink.shapes()
        staged: list[StagedFile] = []
        sums, since = self._sums, self._since_recompute
        partials: list[StateDigest] = []
        recomputed = False
        for data, path in files:
            parsed = self._parse(data, path, run_id, version, shapes)
            meta = parsed.meta
            if meta.run_id == run_id and meta.version == version:
                continue  # a version already held (a repeated notification)
            _check_chain(meta, run_id, version, shapes, path)
            on_held = meta.kind == "delta" and not staged
            due = self.recompute_every and since >= self.recompute_every
            if on_held and due and self.verify and self._sums is not None:
                self._recompute()
                since, recomputed = 0, True
            try:
                file, sums, since, partial = self._stage(parsed, staged, sums, since)
            except DigestMismatch:
                if on_held and self.verify and not recomputed:
                    self._recompute()  # held bytes that drifted explain it: name the tensor
                raise
            if meta.kind == "anchor":
                shapes = {n: e.shape for n, e in meta.tensors.items()}
            staged.append(file)
            if partial is not None:
                partials.append(partial)
            run_id, version = meta.run_id, meta.version
        sink_state = self.sink.stage(staged) if staged else None
        return StagedUpdate(base, tuple(staged), sink_state, sums, since, tuple(partials))

    def _parse(
        self,
        data: FileData,
        path: str | None,
        run_id: str | None,
        version: int | None,
        shapes: Shapes,
    ) -> ParsedFile | StoredFile | ParsedParts:
        known = len(shapes) or None  # a replica that knows its model bounds every header
        if isinstance(data, tuple):  # the parts of a sharded version, read as one file
            return ParsedParts.of([_parsed(d, path, known) for d in data], path=path)
        parsed = _parsed(data, path, known)
        if parsed.meta.part is not None:
            raise FormatError(
                "a part of a sharded version is applied with all its parts", path=path
            )
        if not parsed.meta.legacy:
            return parsed
        if not self.allow_legacy or isinstance(parsed, StoredFile):
            raise FormatError(
                "TRL v1 file without run id or digests; construct the Replica with "
                "allow_legacy=True to apply it unverified",
                path=path,
            )
        return parsed.normalised(run_id, version, shapes)

    def _stage(
        self,
        parsed: ParsedFile | ParsedParts,
        staged: Sequence[StagedFile],
        sums: Mapping[str, StateDigest] | None,
        since: int,
    ) -> tuple[StagedFile, Mapping[str, StateDigest] | None, int, StateDigest | None]:
        """Decode one file against the state the staged ones lead to and verify it; returns it
        with the per-tensor full-state digests after it (and, for a sink holding boxes, its share of
        the state digest, checked only once combined with the other workers')."""
        meta, path = parsed.meta, parsed.path
        boxes = self.sink.boxes({n: e.shape for n, e in meta.tensors.items()})
        if boxes is not None and self.verify and meta.state_digest is None:
            raise FormatError(
                "a replica holding boxes verifies through the full-state digest, which this "
                "file does not carry (protocol 1); serve it with tensor parallel size 1",
                path=path,
            )
        if meta.source is not None and self.sources is not None:  # a bucket writer's choice
            self.sources.check(meta.source, {n: e.shape for n, e in meta.tensors.items()})
        into = _staged_anchor(staged)
        if meta.kind == "delta" and into is not None and isinstance(parsed, ParsedFile):
            return self._stage_into(parsed, staged, into, sums, since, boxes)
        state = staged_state(self.sink.tensors(), staged)
        decoded = decode(parsed, base=state, boxes=boxes)
        # A delta with a full-state digest is verified by it in O(changed); whole-tensor hashes
        # check anchors and protocol 1 deltas (not boxes of them, which have no such hash).
        per_tensor = boxes is None and (meta.kind == "anchor" or meta.state_digest is None)
        updated = _checked_updates(
            decoded, state, self.verify and per_tensor, self.sink.keeps_tensors, path
        )
        if boxes is not None and self.verify and meta.kind == "anchor":
            _check_whole_boxes(decoded, boxes, path)
        file = StagedFile(meta, path, decoded, updated)
        if not self.verify:
            return file, None, 0, None
        if sums is None and meta.kind == "delta":  # held while verification was off
            sums, since = self.sink.state_sums(), 0
        sums, since = _sums_once_applied(decoded, sums, since, boxes)
        if boxes is not None:
            return file, sums, since, total(sums)
        _check_state(meta, total(sums), path)
        return file, sums, since, None

    def _stage_into(
        self,
        parsed: ParsedFile,
        staged: Sequence[StagedFile],
        into: Mapping[str, torch.Tensor],
        sums: Mapping[str, StateDigest] | None,
        since: int,
        boxes: Boxes | None,
    ) -> tuple[StagedFile, Mapping[str, StateDigest] | None, int, StateDigest | None]:
        """`_stage` for a delta staged after an anchor of the same update: the anchor's tensors
        are the update's own (nothing serves them yet), so each tensor's changes are written
        into them as soon as they are decoded and verified, then dropped; the reader holds one
        tensor's changes at a time, not the delta's. A file that fails leaves the staged
        tensors half written, and the whole update is refused with it."""
        meta, path = parsed.meta, parsed.path
        moved: dict[str, StateDigest] = {}
        per_tensor = boxes is None and meta.state_digest is None  # protocol 1: tensor digests

        def write(name: str, change: TensorChange) -> None:
            if self.verify and sums is not None:
                owned = change if boxes is None else box_change_sums({name: change}, boxes)
                if isinstance(owned, TensorChange):
                    moved[name] = change_sum(name, owned)
                elif owned:
                    moved[name] = change_sum(name, owned[name])
            scatter(into[name], change.indices, change.values)
            if self.verify and per_tensor:
                _check_digest(name, into[name], meta.tensors[name].digest, path)

        state = staged_state(self.sink.tensors(), staged)
        decoded = decode(parsed, base=state, boxes=boxes, consume=write)
        file = StagedFile(meta, path, decoded)  # its changes live in the anchor's tensors now
        if not self.verify or sums is None:
            return file, None, 0, None
        moved_sums = {name: s + moved[name] if name in moved else s for name, s in sums.items()}
        if boxes is not None:
            return file, moved_sums, since + 1, total(moved_sums)
        _check_state(meta, total(moved_sums), path)
        return file, moved_sums, since + 1, None

    def _recompute(self) -> None:
        """Recompute the held state's digests and compare them with the running ones.

        Raises:
            DigestMismatch: a tensor's bytes changed without a delta; the replica then forgets
                its version (its state is no version of the run), so the next update reloads.
        """
        running = self._sums
        if running is None:
            return  # nothing verified to compare with
        found = self.sink.state_sums()
        if self._sums is not running:
            return  # a commit moved the state meanwhile; it also refuses this staging's base
        for name in sorted(set(running) | set(found)):
            if running.get(name) != found.get(name):
                expected, held, version = running.get(name), found.get(name), self.version
                self.forget()
                message = (
                    f"tensor {name!r} no longer matches version {version}: its bytes "
                    f"changed without a delta (running digest {expected}, recomputed "
                    f"{held}); the update is refused and the next one reloads an anchor"
                )
                raise DigestMismatch(name, str(expected), str(held), message=message)

    def commit(
        self, staged: StagedUpdate, combined: Sequence[StateDigest] | None = None
    ) -> list[int]:
        """Make a staged update current (the pause); returns the versions applied.

        A sink holding boxes's update needs `combined`: for each file, the sum of every worker's
        `partials` (the workers exchange them); each must be the digest the file promises.

        Raises:
            ChainError: the state moved since `stage`.
            DigestMismatch: a combined digest differs from its file's (nothing changes).
        """
        if staged.partials:
            if combined is None or len(combined) != len(staged.files):
                raise ValueError(
                    "an update of a replica holding boxes commits with every worker's "
                    f"combined digests ({len(staged.files)}), got {combined!r}"
                )
            for file, digest in zip(staged.files, combined, strict=True):
                _check_state(file.meta, digest, file.path)
        if staged.base != (self.run_id, self.version):
            raise ChainError(
                f"update staged on {staged.base} but the replica holds "
                f"{(self.run_id, self.version)}",
                expected=staged.base,
                found=(self.run_id, self.version),
            )
        if not staged.files:
            return []
        try:
            self.sink.commit(staged.files, staged.sink_state)
        except BaseException:
            if not self.sink.shapes():  # the sink could not undo: no version is known any more
                self.forget()
            raise
        last = staged.files[-1].meta
        self.run_id, self.version = last.run_id, last.version
        self._sums, self._since_recompute = staged.sums, staged.since_recompute
        self._digest = None
        if staged.sums is not None:
            self._digest = combined[-1] if staged.partials else total(staged.sums)
        return staged.versions

    def forget(self) -> None:
        """Hold no known version any more (the bytes stay): the next update replays from an
        anchor. For states found inconsistent where the replica cannot name the cause."""
        self.run_id, self.version, self._sums, self._digest = None, None, None, None

    def update(self, data: FileData, *, path: str | None = None) -> bool:
        """Stage and commit one file; False when it was a version already held (nothing to do)."""
        return bool(self.commit(self.stage([(data, path)])))

    def sync(
        self,
        store: Store,
        *,
        target: int | None = None,
        path: str | None = None,
        manifest: bytes | None = None,
    ) -> list[int]:
        """Catch up with the bucket (bootstrap when empty), all or nothing; returns the versions
        applied. `target` (default: the latest) may be older than the latest version. A bucket
        with no manifest is a `ChainError`: there is no version to hold.

        A driven sync names the file it was told of (`path`, which must be the manifest's for
        `target`): the next delta is then read beside the manifest, one round trip in all. A
        follower passes the `manifest` bytes its poll read, which are not read again
        (`replica.driven`)."""
        held = self.state_digest
        planned = plan_sync(
            store,
            (self.run_id, self.version),
            target,
            digest=held and held.hex(),
            shapes=self.sink.shapes(),
            path=path,
            manifest=manifest,
        )
        if planned is None:
            raise ChainError(
                f"{store.url} has no manifest: nothing was published there (a wrong path, or "
                "a publisher that has not committed its first version yet)",
                expected="manifest.json",
                found=None,
            )
        fetch = planned.fetch(bounded_by(self))
        return replay(store, planned.entries, self, streaming=False, fetch=fetch)

    def digests(self) -> dict[str, str]:
        return {name: tensor_digest(t) for name, t in self.sink.tensors().items()}

    def check_digests(self, meta: FileMetadata) -> None:
        """Check every held tensor against a file's digests (e.g. the latest anchor's); a sharded
        version has none (no part holds a whole tensor)."""
        tensors = self.sink.tensors()
        for name, entry in meta.tensors.items():
            if entry.digest is not None:
                _check_digest(name, tensors[name], entry.digest, None)


def _staged_anchor(staged: Sequence[StagedFile]) -> Mapping[str, torch.Tensor] | None:
    """The tensors of the last anchor staged in this update (its own, not yet served), which
    the deltas staged after it are written into; None when the update has no anchor."""
    anchors = [f for f in staged if f.meta.kind == "anchor"]
    return anchors[-1].decoded.tensors if anchors else None


def _parsed(
    data: bytes | StoredFile, path: str | None, tensors: int | None
) -> ParsedFile | StoredFile:
    """A file read whole, parsed (its header bounded by `tensors`); a stored one (an anchor,
    `manifest.fetch_entry`) was checked when its header was read."""
    if isinstance(data, StoredFile):
        return data
    return ParsedFile.parse(data, path=path, tensors=tensors)


def _check_chain(
    meta: FileMetadata, run_id: str | None, version: int | None, shapes: Shapes, path: str | None
) -> None:
    """The chain rules: where a file may apply, given the state it would apply to."""
    where = f" ({path})" if path else ""
    if meta.kind == "anchor":
        if meta.run_id == run_id and version is not None and meta.version < version:
            raise ChainError(  # a late notification: going back would serve stale weights
                f"anchor {meta.version} of run {meta.run_id!r} is older than version "
                f"{version}, which the replica holds{where}",
                expected=version,
                found=meta.version,
            )
    elif version is None:
        raise ChainError(
            f"cannot apply delta {meta.version} to an empty replica; load an anchor first",
            expected="anchor",
            found="delta",
        )
    elif meta.run_id != run_id:
        raise ChainError(
            f"delta of run {meta.run_id!r} refused: replica holds run {run_id!r}{where}",
            expected=run_id,
            found=meta.run_id,
        )
    elif meta.base_version != version:
        raise ChainError(
            f"delta {meta.version} has base {meta.base_version} but replica is at {version}{where}",
            expected=version,
            found=meta.base_version,
        )
    theirs = {n: e.shape for n, e in meta.tensors.items()}
    if not theirs:
        raise FormatError(f"the {meta.kind} names no tensors: no model is empty", path=path)
    if theirs != shapes and (shapes or meta.kind != "anchor"):  # any model fits an empty one
        diff = sorted(set(shapes.items()) ^ set(theirs.items()))[:5]
        raise FormatError(f"{meta.kind} is for another model: tensors differ {diff}", path=path)


def _sums_once_applied(
    decoded: DecodedFile, sums: Mapping[str, StateDigest] | None, since: int, boxes: Boxes | None
) -> tuple[Mapping[str, StateDigest], int]:
    """Per-tensor full-state digests after a file: a full pass over an anchor, O(changed) for a
    delta (from its changed elements' previous and new values; `sums` are the base's). With
    `boxes`, of the owned boxes only, at the elements' global indices."""
    if decoded.meta.kind == "anchor":
        if boxes is not None:
            return box_sums(decoded.tensors, boxes), 0
        return state_sums(decoded.tensors), 0
    assert sums is not None  # `_stage` computes them for a delta on a state held unverified
    changes = decoded.changes if boxes is None else box_change_sums(decoded.changes, boxes)
    return apply_changes(sums, changes), since + 1


def _check_state(meta: FileMetadata, found: StateDigest, path: str | None) -> None:
    """The state after a file must have the full-state digest the file promises (protocol 2)."""
    if meta.state_digest is not None and found != meta.state_digest:
        message = (
            f"full-state digest mismatch{f' from {path}' if path else ''}: the state after "
            f"version {meta.version} would be {found}, the file promises "
            f"{meta.state_digest}; nothing was applied"
        )
        raise DigestMismatch("", meta.state_digest.hex(), found.hex(), path=path, message=message)


def _check_whole_boxes(decoded: DecodedFile, boxes: Boxes, path: str | None) -> None:
    """A slice that is the whole tensor (a norm every worker holds) is checked against the
    anchor's per-tensor digest: a worker that does not own it adds it to no digest share."""
    for name, tensor in decoded.tensors.items():
        if boxes[name].is_whole:
            _check_digest(name, tensor, decoded.meta.tensors[name].digest, path)


def _check_digest(
    name: str,
    tensor: torch.Tensor,
    expected: str | None,
    path: str | None,
    found: str | None = None,
) -> None:
    """A tensor's bytes must hash to its digest in the file (None: nothing to check); `found`:
    their digest, when it was computed as they were read."""
    if expected is not None and (found := found or tensor_digest(tensor)) != expected:
        raise DigestMismatch(name, expected, found, path=path)


def _checked_updates(
    decoded: DecodedFile, state: StagedState, verify: bool, keep: bool, path: str | None
) -> dict[str, torch.Tensor]:
    """Check every tensor a file sets against its post-update digest (None: unverifiable);
    returns a delta's post-update copies of touched tensors when `keep`.

    A delta is checked on copies with the changes applied, so nothing the model serves is
    written before the whole file is known to be right; the copies are made in a small thread
    pool (numpy's scatter and xxhash release the GIL), one per worker at a time unless kept.
    """
    meta = decoded.meta

    def expect(name: str, tensor: torch.Tensor) -> None:
        if verify:
            found = decoded.digests.get(name)  # computed as an anchor's bytes were read
            _check_digest(name, tensor, meta.tensors[name].digest, path, found)

    if meta.kind == "anchor":
        for name, tensor in decoded.tensors.items():
            expect(name, tensor)
        return {}
    if not keep and not verify:
        return {}

    def patched(name: str) -> tuple[str, torch.Tensor | None]:
        change = decoded.changes[name]
        tensor = state.get_copy(name, private=True)
        scatter(tensor, change.indices, change.values)
        expect(name, tensor)
        return name, tensor if keep else None

    with ThreadPoolExecutor(WORKERS) as pool:
        return {n: t for n, t in pool.map(patched, decoded.changes) if t is not None}
