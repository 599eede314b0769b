"""The manifest: the bucket's single commit point, naming the run and its chain of files."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from deltasync.errors import ChainError, FormatError, StoreError
from deltasync.store import MissingFile, RefusedObject, Store, validate_path
from deltasync.wire.digests import StateDigest, bytes_digest, total
from deltasync.wire.encodings import holds_weights
from deltasync.wire.fields import is_int, keys_exactly
from deltasync.wire.header import header_budget
from deltasync.wire.metadata import (
    MAX_PARTS,
    PROTOCOL,
    FileMetadata,
    ParsedFile,
    check_protocol,
    validate_run_id,
)
from deltasync.wire.stored import StoredFile

__all__ = [
    "MANIFEST_PATH",
    "ChainEntry",
    "FileData",
    "Manifest",
    "PartRef",
    "check_declared_size",
    "check_file",
    "check_promise",
    "fetch_entry",
    "fetch_file",
    "file_path",
    "largest_file",
    "metrics_path",
    "open_stored",
    "read_manifest",
    "read_manifest_bytes",
]

MANIFEST_PATH = "manifest.json"
_HEX128 = re.compile(r"[0-9a-f]{32}")
_FENCING = ("epoch", "previous")  # manifest keys since protocol 5
_BEFORE_FENCING = ("deltasync/1", "deltasync/2", "deltasync/3", "deltasync/4")
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MANIFEST_PROBE_BYTES = 1024 * 1024  # a manifest this small is read in one round trip
# one file, or the parts of a sharded version in order; an anchor's files are `StoredFile`s
FileData = bytes | StoredFile | tuple[bytes | StoredFile, ...]


def file_path(
    run_id: str, kind: str, version: int, digest: str, part: tuple[int, int] | None = None
) -> str:
    """`runs/<run>/<anchors|deltas>/<version>-<digest12>.safetensors`: never reused; part
    `i` of `n` of a sharded version: `<version>-part<i>of<n>-<digest12>.safetensors`."""
    folder = {"anchor": "anchors", "delta": "deltas"}[kind]
    share = "" if part is None else f"part{part[0]}of{part[1]}-"
    return f"runs/{run_id}/{folder}/{version:08d}-{share}{digest[:12]}.safetensors"


def metrics_path(run_id: str, version: int) -> str:
    return f"runs/{run_id}/metrics/{version:08d}.json"


@dataclass(frozen=True)
class PartRef:
    """One stored file of a version: its path, size, xxh3-128 and full-state digest (for a
    part of a sharded version, its share of the version's)."""

    path: str
    bytes: int
    digest: str
    state_digest: str | None

    @classmethod
    def from_dict(cls, raw: Any) -> PartRef:
        keys = {f.name for f in cls.__dataclass_fields__.values()}
        if not keys_exactly(raw, keys):
            raise FormatError(f"manifest part {raw!r} has the wrong keys, expected {sorted(keys)}")
        part = cls(**raw)
        if not is_int(part.bytes, minimum=0):
            raise FormatError(f"manifest part {raw!r}: bytes must be an integer")
        if not isinstance(part.digest, str) or not isinstance(part.state_digest, str):
            raise FormatError(f"manifest part {raw!r}: digests must be strings")
        StateDigest.parse(part.state_digest)
        try:
            validate_path(part.path)
        except StoreError as exc:
            raise FormatError(f"manifest part path: {exc}") from None
        return part


@dataclass(frozen=True)
class ChainEntry:
    """One committed version's file: an anchor (full state at `version`) or a delta
    (`version - 1` -> it).

    `state_digest` is the file's own full-state digest (the state after it), so a reader knows
    it before downloading; None only for a file written with protocol 1. A sharded version
    (protocol 3) is stored as `parts`, one file per trainer rank, and then has no `path` or
    `digest` of its own; `bytes` is the parts' sum and `state_digest` their digests' sum.
    """

    version: int
    kind: Literal["anchor", "delta"]
    path: str | None
    bytes: int
    digest: str | None
    encoding: str
    changed_elements: int
    state_digest: str | None = None
    parts: tuple[PartRef, ...] | None = None

    @property
    def base_version(self) -> int | None:
        return self.version - 1 if self.kind == "delta" else None

    @property
    def fetch_bytes(self) -> int:
        """What a reader downloads to apply it: its files, or for a virtual anchor (a file that
        names a checkpoint) the model's bf16 bytes, read from that checkpoint."""
        return self.bytes if holds_weights(self.encoding) else 2 * self.changed_elements

    @property
    def files(self) -> tuple[PartRef, ...]:
        """The stored files of this version: its one file, or its parts in order."""
        if self.parts is not None:
            return self.parts
        return (PartRef(self.path, self.bytes, self.digest, self.state_digest),)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """A name for messages: the path, or the first part's and how many there are."""
        if self.parts is None:
            return str(self.path)
        return f"{self.parts[0].path} (+{len(self.parts) - 1} parts)"

    @classmethod
    def from_dict(cls, raw: Any, *, protocol: int = 3) -> ChainEntry:
        keys = {f.name for f in cls.__dataclass_fields__.values()}
        if protocol < 3:  # protocol 2 entries have no parts
            keys.discard("parts")
        if protocol < 2:  # protocol 1 entries have no state digest
            keys.discard("state_digest")
        if not keys_exactly(raw, keys):
            raise FormatError(f"manifest entry {raw!r} has the wrong keys, expected {sorted(keys)}")
        raw = dict(raw)
        parts = raw.pop("parts", None)
        if parts is not None:
            if not isinstance(parts, list) or not 2 <= len(parts) <= MAX_PARTS:
                raise FormatError(f"manifest entry parts must be a list of 2..{MAX_PARTS} parts")
            parts = tuple(PartRef.from_dict(p) for p in parts)
        entry = cls(**raw, parts=parts)
        if entry.state_digest is not None:
            StateDigest.parse(entry.state_digest)
        ints = (entry.version, entry.bytes, entry.changed_elements)
        if not all(is_int(v, minimum=0) for v in ints):
            raise FormatError(f"manifest entry {raw!r}: version, bytes, changed must be integers")
        if entry.kind not in ("anchor", "delta") or entry.version < 1:
            raise FormatError(f"manifest entry {raw!r}: bad kind or version")
        if not isinstance(entry.encoding, str):
            raise FormatError(f"manifest entry {raw!r}: encoding must be a string")
        if entry.parts is None:
            if not isinstance(entry.digest, str) or not isinstance(entry.path, str):
                raise FormatError(f"manifest entry {raw!r}: path and digest must be strings")
            try:
                validate_path(entry.path)
            except StoreError as exc:
                raise FormatError(f"manifest entry path: {exc}") from None
        else:
            _check_parts(entry)
        return entry


def _check_parts(entry: ChainEntry) -> None:
    """A sharded entry names no file of its own and adds up its parts' sizes and digests."""
    parts = entry.parts or ()
    if entry.path is not None or entry.digest is not None:
        raise FormatError(f"sharded manifest entry {entry.version}: path and digest must be null")
    if entry.bytes != sum(p.bytes for p in parts):
        raise FormatError(f"sharded manifest entry {entry.version}: bytes differ from its parts'")
    combined = total(StateDigest.parse(p.state_digest) for p in parts)
    if entry.state_digest != combined.hex():
        raise FormatError(
            f"sharded manifest entry {entry.version}: state digest {entry.state_digest} is not "
            f"the sum of its parts' ({combined})"
        )


@dataclass(frozen=True)
class Manifest:
    """Run id, latest version, the retained anchors and the deltas after the oldest of them.

    Every version after the first has a delta (anchor versions too), so a live replica always
    moves by a small file; anchors serve cold starts. Deltas are contiguous: delta v has base v-1.

    Fencing (protocol 5): `epoch` numbers the publisher that wrote it (each publisher that
    starts or takes over a run in the bucket writes the previous epoch + 1) and `previous` is the
    xxh3-128 of the manifest bytes it replaced (None: the bucket was empty), so a commit can be
    a compare-and-swap and any reader can tell a fork. Older manifests read as epoch 0.
    """

    run_id: str
    latest_version: int
    anchors: tuple[ChainEntry, ...]
    deltas: tuple[ChainEntry, ...]
    model_bytes: int
    updated_at: float = field(default_factory=time.time)
    protocol: str = PROTOCOL
    epoch: int = 1
    previous: str | None = None

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if not is_int(self.epoch, minimum=0):
            raise FormatError(f"manifest epoch must be a non-negative integer, got {self.epoch!r}")
        if self.previous is not None and not _HEX128.fullmatch(str(self.previous)):
            raise FormatError(f"manifest previous must be null or 32 hex digits: {self.previous!r}")
        if not self.anchors:
            raise FormatError("manifest has no anchor")
        versions = [d.version for d in self.deltas]
        if versions and versions != list(range(versions[0], versions[0] + len(versions))):
            raise FormatError(f"manifest deltas are not contiguous: {versions[:10]}")
        if any(a.kind != "anchor" for a in self.anchors) or any(
            d.kind != "delta" for d in self.deltas
        ):
            raise FormatError("manifest lists a delta among anchors or an anchor among deltas")
        newest = max([a.version for a in self.anchors] + versions)
        if newest != self.latest_version:
            raise FormatError(f"latest_version {self.latest_version} but newest file is {newest}")
        oldest_anchor = min(a.version for a in self.anchors)
        if versions and versions[0] > oldest_anchor + 1:
            raise FormatError("manifest deltas do not start right after the oldest anchor")
        if not versions and self.latest_version != self.latest_anchor.version:
            raise FormatError("manifest chain ends before latest_version")

    @property
    def latest_anchor(self) -> ChainEntry:
        return max(self.anchors, key=lambda a: a.version)

    def deltas_after(self, version: int) -> list[ChainEntry]:
        return [d for d in self.deltas if d.version > version]

    def plan(
        self,
        run_id: str | None,
        version: int | None,
        target: int | None = None,
        *,
        digest: str | None = None,
    ) -> list[ChainEntry]:
        """Files a reader at (`run_id`, `version`) applies, in order, to reach `target`.

        The one chain planner (replica, vLLM engine, CLI). `target` defaults to the latest
        version; a notification can trail the manifest, so it may be older. Of the routes the
        bucket still holds - the reader's own version replayed by deltas, or the newest anchor at
        or before `target` plus the deltas after it - the one with fewer bytes to fetch wins (a
        virtual anchor costs the model's bytes).

        `digest` (the reader's full-state digest) detects a fork: a reader holding a `version`
        that another publisher wrote differently (a best-effort store lost a race) is refused
        before it downloads anything.

        Raises:
            ChainError: the bucket cannot produce `target` for this reader: not written yet,
                pruned by retention, the reader is already past it, or holds a fork.
        """
        target = self.latest_version if target is None else target
        if target > self.latest_version:
            raise ChainError(
                f"version {target} is not in the bucket yet (latest {self.latest_version})",
                expected=self.latest_version,
                found=target,
            )
        same_run = run_id == self.run_id and version is not None
        bucket_digest = self.version_digest(version) if same_run and digest else None
        if bucket_digest is not None and bucket_digest != digest:
            raise ChainError(
                f"fork: the reader's version {version} (state digest {digest}) is not the "
                f"bucket's version {version} ({bucket_digest}): another publisher rewrote it; "
                "restart the reader to load the bucket's chain",
                expected=bucket_digest,
                found=digest,
            )
        if same_run and version == target:
            return []
        if same_run and version > target:
            raise ChainError(
                f"reader is at version {version}, past the requested {target}",
                expected=target,
                found=version,
            )
        routes = [self._deltas(version, target)] if same_run else []
        anchors = [a for a in self.anchors if a.version <= target]
        if anchors:
            anchor = max(anchors, key=lambda a: a.version)
            tail = self._deltas(anchor.version, target)
            routes.append(None if tail is None else [anchor, *tail])
        found = [r for r in routes if r is not None]
        if not found:
            raise ChainError(
                f"the bucket no longer holds a route to version {target} (retained anchors "
                f"{[a.version for a in self.anchors]}, deltas from "
                f"{self.deltas[0].version if self.deltas else '-'})",
                expected=target,
                found=None,
            )
        return min(found, key=lambda r: sum(e.fetch_bytes for e in r))

    def _deltas(self, after: int, target: int) -> list[ChainEntry] | None:
        """The contiguous deltas after..target, or None if the chain does not cover them."""
        deltas = [d for d in self.deltas if after < d.version <= target]
        if [d.version for d in deltas] != list(range(after + 1, target + 1)):
            return None
        return deltas

    def with_version(self, entries: list[ChainEntry], keep_anchors: int) -> Manifest:
        """The next manifest: `entries` (a delta and/or an anchor of one new version) appended,
        keeping the newest `keep_anchors` anchors and only the deltas after the oldest kept one."""
        new_version = entries[0].version
        if new_version != self.latest_version + 1:
            raise ChainError(
                f"version {new_version} does not follow {self.latest_version}",
                expected=self.latest_version + 1,
                found=new_version,
            )
        anchors = [*self.anchors, *(e for e in entries if e.kind == "anchor")]
        anchors = sorted(anchors, key=lambda a: a.version)[-max(1, keep_anchors) :]
        oldest = anchors[0].version
        deltas = [d for d in (*self.deltas, *entries) if d.kind == "delta" and d.version > oldest]
        model_bytes = next((e.bytes for e in entries if e.kind == "anchor"), self.model_bytes)
        return replace(
            self,
            latest_version=new_version,
            anchors=tuple(anchors),
            deltas=tuple(deltas),
            model_bytes=model_bytes,
            updated_at=time.time(),
            protocol=PROTOCOL,  # a run resumed across an upgrade is written as this protocol
        )

    def referenced_paths(self) -> set[str]:
        return {f.path for e in (*self.anchors, *self.deltas) for f in e.files}

    def committed_after(self, previous: bytes | None, epoch: int) -> Manifest:
        """This manifest as the commit that replaces `previous` (the bytes read or written
        last; None: an empty bucket), written by publisher `epoch`."""
        return replace(
            self, epoch=epoch, previous=None if previous is None else bytes_digest(previous)
        )

    def version_digest(self, version: int) -> str | None:
        """The full-state digest the bucket gives `version`, when a retained entry names it."""
        digests = (e.state_digest for e in (*self.anchors, *self.deltas) if e.version == version)
        return next((d for d in digests if d is not None), None)

    def to_json(self) -> bytes:
        raw = asdict(self)
        if self.protocol in _BEFORE_FENCING:
            for key in _FENCING:
                del raw[key]
        for entry in (*raw["anchors"], *raw["deltas"]):  # as read: older entries lack keys
            if self.protocol in ("deltasync/1", "deltasync/2"):
                del entry["parts"]
            if self.protocol == "deltasync/1":
                del entry["state_digest"]
        return json.dumps(raw, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: str = MANIFEST_PATH) -> Manifest:
        """Parse and validate; raises `FormatError` for anything unexpected."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(
                f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}", path=path
            )
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as exc:  # also too deep or a number too long
            raise FormatError(f"manifest is not JSON: {exc}", path=path) from None
        if not isinstance(raw, dict):
            raise FormatError(f"manifest is a JSON {type(raw).__name__}, not an object", path=path)
        protocol = check_protocol(raw.get("protocol"), what="manifest", path=path)  # first
        keys = {f.name for f in cls.__dataclass_fields__.values()}
        if protocol < 5:  # normalised here: older manifests have no fencing
            keys -= set(_FENCING)
        if set(raw) != keys:
            raise FormatError(f"manifest keys {sorted(raw)}, expected {sorted(keys)}", path=path)
        try:
            for key in ("anchors", "deltas"):
                if not isinstance(raw[key], list):
                    raise FormatError(f"manifest {key} must be a list")
            for key in ("latest_version", "model_bytes"):
                if not is_int(raw[key], minimum=0):
                    raise FormatError(f"manifest {key} must be a non-negative integer")
            if not isinstance(raw["updated_at"], (int, float)):
                raise FormatError("manifest updated_at must be a number")
            manifest = cls(
                run_id=raw["run_id"],
                latest_version=raw["latest_version"],
                anchors=tuple(ChainEntry.from_dict(a, protocol=protocol) for a in raw["anchors"]),
                deltas=tuple(ChainEntry.from_dict(d, protocol=protocol) for d in raw["deltas"]),
                model_bytes=raw["model_bytes"],
                updated_at=float(raw["updated_at"]),
                protocol=raw["protocol"],
                epoch=raw.get("epoch", 0),
                previous=raw.get("previous"),
            )
            for entry in (*manifest.anchors, *manifest.deltas):
                # Only this run's files, named by version and digest (never the manifest,
                # a metrics record or another run's file), before anything is read.
                for index, file in enumerate(entry.files):
                    part = None if entry.parts is None else (index, len(entry.files))
                    expected = file_path(
                        manifest.run_id, entry.kind, entry.version, file.digest, part
                    )
                    if file.path != expected:
                        raise FormatError(
                            f"manifest entry path {file.path!r} is not this run's {entry.kind} "
                            f"file for version {entry.version} ({expected!r})"
                        )
            _check_one_state_per_version(manifest)
            return manifest
        except (FormatError, TypeError, OverflowError) as exc:  # float(10**400): OverflowError
            raise FormatError(f"invalid manifest: {exc}", path=path) from None


def _check_one_state_per_version(manifest: Manifest) -> None:
    """An anchor and a delta of one version lead to one state: they promise one digest
    (protocol 1 entries carry none)."""
    promised: dict[int, str] = {}
    for entry in (*manifest.anchors, *manifest.deltas):
        if entry.state_digest is None:
            continue
        first = promised.setdefault(entry.version, entry.state_digest)
        if first != entry.state_digest:
            raise FormatError(
                f"version {entry.version}: its anchor and delta promise different full-state "
                f"digests ({first} and {entry.state_digest})"
            )


def read_manifest(store: Store) -> Manifest | None:
    """The bucket's manifest, or None for an empty bucket (its bytes read as
    `read_manifest_bytes` does: never an oversized object held in memory)."""
    data = read_manifest_bytes(store)
    return None if data is None else Manifest.from_json(data)


def read_manifest_bytes(store: Store) -> bytes | None:
    """The manifest's bytes (None for an empty bucket), never more than `MAX_MANIFEST_BYTES`
    read.

    One round trip for a manifest up to `MANIFEST_PROBE_BYTES` (every follower's poll): a read
    that stops one byte past it. Only a larger one costs more: its size is checked, then the
    read stops past the limit even when the object grew (or lied about its size) in between."""
    try:
        try:
            return store.get(MANIFEST_PATH, limit=MANIFEST_PROBE_BYTES)
        except RefusedObject:
            pass
        size = store.size(MANIFEST_PATH)
        if size > MAX_MANIFEST_BYTES:
            raise FormatError(
                f"manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES}; not downloaded",
                path=MANIFEST_PATH,
            )
        return store.get(MANIFEST_PATH, limit=MAX_MANIFEST_BYTES)
    except MissingFile:
        return None


def largest_file(kind: str, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes one file of `kind` can hold for a model of `shapes`: an anchor stores each
    element once in bf16 (2 B); a delta at most every element changed, at `coo`'s 6 B each
    (int32 index and bf16 value; `ctx`, `ans` and `packed` take less); plus the largest header."""
    elements = sum(math.prod(shape) for shape in shapes.values())
    return (2 if kind == "anchor" else 6) * elements + 8 + header_budget(len(shapes))


def check_declared_size(
    entry: ChainEntry, file: PartRef, shapes: Mapping[str, tuple[int, ...]] | None
) -> None:
    """Refuse, before any read, a file declared larger than `entry`'s kind can be for the
    reader's model (`shapes`; None: a reader that does not know its model yet)."""
    if shapes and file.bytes > (limit := largest_file(entry.kind, shapes)):
        raise FormatError(
            f"the manifest declares {file.bytes} bytes, more than a {entry.kind} of this model "
            f"can hold ({limit}); not downloaded",
            path=file.path,
        )


def fetch_entry(
    store: Store, entry: ChainEntry, *, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> FileData:
    """A manifest entry's files (every part of a sharded version, in order), each checked
    against the manifest before its tensors are read: its declared size against the reader's
    model (`shapes`, when it knows it; the model also bounds each header before its JSON is
    parsed), then a header that is a valid safetensors header of this entry's kind and encoding
    promising the entry's full-state digest (a part: its share).

    An anchor is as large as the model: it comes back as a `StoredFile` (its header read and
    checked, its bytes read later in pieces, with its size and digest checked as they pass).
    A delta (or a virtual anchor, a header alone) is read whole, its size and digest checked
    before it is parsed."""
    for file in entry.files:  # every part before the first byte of any
        check_declared_size(entry, file, shapes)
    tensors = len(shapes) if shapes else None
    if entry.kind == "anchor" and holds_weights(entry.encoding):
        found: tuple[bytes | StoredFile, ...] = tuple(
            open_stored(store, file, entry, tensors=tensors) for file in entry.files
        )
    else:
        found = tuple(fetch_file(store, file, tensors=tensors, entry=entry) for file in entry.files)
    return found[0] if entry.parts is None else found


def open_stored(
    store: Store, file: PartRef, entry: ChainEntry | None = None, *, tensors: int | None = None
) -> StoredFile:
    """One stored file of a version, its header read and checked as `fetch_entry` does; its
    bytes are read as the reader consumes them (`StoredFile.stream`)."""
    stored = StoredFile.open(store, file.path, file.bytes, file.digest, tensors=tensors)
    check_promise(file, stored.meta, entry)
    return stored


def fetch_file(
    store: Store, file: PartRef, *, tensors: int | None = None, entry: ChainEntry | None = None
) -> bytes:
    """One stored file of a version (a whole file or one part), read whole and checked as
    `fetch_entry` does (the declared size is the caller's to bound: `check_declared_size`)."""
    try:  # never reads past the declared size (+1); a large file as parallel ranges
        data = store.get_sized(file.path, file.bytes)
    except RefusedObject as exc:
        raise FormatError(f"file does not match the manifest: {exc}", path=file.path) from None
    return check_file(file, data, tensors=tensors, entry=entry)


def check_file(
    file: PartRef, data: bytes, *, tensors: int | None = None, entry: ChainEntry | None = None
) -> bytes:
    """`data` if it is `file` as the manifest describes it: its size, its whole-file xxh3-128,
    then a header (bounded by `tensors`, the reader's tensor count) that keeps the manifest's
    promises (`check_promise`). The one check of a file's bytes read whole, however they were
    read (`fetch_file`, or a driven sync's read begun before the manifest's, `replica.driven`)."""
    if len(data) != file.bytes or bytes_digest(data) != file.digest:
        raise FormatError(
            f"file does not match the manifest ({len(data)} bytes, expected "
            f"{file.bytes}, or digest differs)",
            path=file.path,
        )
    check_promise(file, ParsedFile.parse(data, path=file.path, tensors=tensors).meta, entry)
    return data


def check_promise(file: PartRef, meta: FileMetadata, entry: ChainEntry | None = None) -> None:
    """A file's header must say what the manifest says of it: the full-state digest (a part:
    its share) and, given its `entry`, the entry's kind and encoding."""
    found = meta.state_digest
    if (found and found.hex()) != file.state_digest:
        raise FormatError(
            f"file's state digest {found} differs from the manifest's {file.state_digest}",
            path=file.path,
        )
    if entry is not None and (meta.kind, meta.encoding) != (entry.kind, entry.encoding):
        raise FormatError(
            f"the file is a {meta.kind} encoded {meta.encoding!r}, the manifest says a "
            f"{entry.kind} encoded {entry.encoding!r}",
            path=file.path,
        )
