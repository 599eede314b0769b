"""File metadata: the typed record behind the string `__metadata__` of every file we write."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from deltasync.errors import FormatError
from deltasync.wire.digests import ALGORITHM as STATE_DIGEST_ALGORITHM
from deltasync.wire.digests import DIGEST_ALGORITHM, StateDigest, total
from deltasync.wire.encodings import Kind, spec_of, tags
from deltasync.wire.fields import is_int, keys_exactly
from deltasync.wire.header import SafetensorsHeader, parse_header, parse_header_bytes
from deltasync.wire.source import ModelSource

__all__ = [
    "ENCODINGS",
    "MAX_PARTS",
    "PROTOCOL",
    "READABLE_PROTOCOLS",
    "FileMetadata",
    "HeadedFile",
    "ParsedFile",
    "ParsedParts",
    "PartInfo",
    "TensorEntry",
    "check_protocol",
    "check_tiling",
    "read_metadata",
    "validate_run_id",
]

PROTOCOL = "deltasync/6"  # bump on any change of the wire format (bucket_layout.md)
# 1: before the full-state digest; 2: before sharded versions (part files); 3: before `ans`
# deltas and virtual anchors; 4: before publisher fencing (the manifest's epoch and previous);
# 5: before `ctx` deltas
READABLE_PROTOCOLS = (*(f"deltasync/{n}" for n in range(1, 6)), PROTOCOL)
_PROTOCOL = re.compile(r"deltasync/([1-9][0-9]{0,5})")
ENCODINGS = tags("delta")  # what a writer may choose (`wire.encodings` registers them)
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX128 = re.compile(r"[0-9a-f]{32}")
_MAX_VERSION = 2**53
MAX_PARTS = 4096  # parts of one sharded version (trainer ranks)


def validate_run_id(run_id: str, *, path: str | None = None) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise FormatError(
            f"invalid run id {run_id!r}: use 1-64 characters of letters, digits, '.', '_', '-'",
            path=path,
        )
    return run_id


def check_protocol(found: object, *, what: str, path: str | None = None) -> int:
    """The protocol number of a file or manifest this reader can read; anything else is refused
    with one line naming both versions."""
    if found in READABLE_PROTOCOLS:
        return int(str(found).split("/")[1])
    match = _PROTOCOL.fullmatch(found) if isinstance(found, str) else None
    if match and int(match.group(1)) > int(PROTOCOL.split("/")[1]):
        raise FormatError(
            f"{what} was written with protocol {found}, but this reader speaks {PROTOCOL}: "
            "upgrade deltasync to read it",
            path=path,
        )
    raise FormatError(
        f"{what} has protocol {found!r}, but this reader speaks {PROTOCOL}", path=path
    )


@dataclass(frozen=True)
class TensorEntry:
    """Per-tensor facts every file carries: the full shape, the post-update digest, changes."""

    shape: tuple[int, ...]
    digest: str | None
    changed: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PartInfo:
    """Which share of a sharded version a part file holds: part `index` of `count`, and per
    tensor the rows `[start, stop)` of dim 0 it covers (a contiguous flat range, since tensors
    are row-major). The parts' rows tile every tensor in index order."""

    index: int
    count: int
    rows: dict[str, tuple[int, int]]

    def flat_range(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """The flat (row-major) element range `[lo, hi)` of `name` this part covers."""
        start, stop = self.rows[name]
        row = math.prod(shape[1:])
        return start * row, stop * row


@dataclass(frozen=True)
class FileMetadata:
    """What a reader needs to decode and check a file, parsed from string metadata in one place.

    `legacy` marks a TRL v1 file (no run id, no base version, no digests, and for a delta only the
    changed tensors): it is only applied when the caller explicitly accepts unverified files, and
    the replica normalises it once (`ParsedFile.normalised`, from `Replica.stage`). Its element
    counts come from its own metadata and header (`from_header`).
    """

    run_id: str | None
    version: int
    base_version: int | None
    kind: Kind
    encoding: str  # a tag `wire.encodings` registers
    tensors: dict[str, TensorEntry]
    legacy: bool = False
    declared: tuple[int, int] | None = None  # TRL v1 delta: (total, changed) elements
    state_digest: StateDigest | None = None  # the whole state after this file; None: protocol 1
    part: PartInfo | None = None  # a part of a sharded version: its share of the state digest
    source: ModelSource | None = None  # a virtual anchor's checkpoint

    @property
    def total_elements(self) -> int:
        """Elements the file covers: the model's, or a part's rows of it."""
        if self.declared is not None:
            return self.declared[0]
        if self.part is not None:
            ranges = (self.part.flat_range(n, e.shape) for n, e in self.tensors.items())
            return sum(hi - lo for lo, hi in ranges)
        return sum(e.numel for e in self.tensors.values())

    @property
    def changed_elements(self) -> int:
        if self.declared is not None:
            return self.declared[1]
        return sum(e.changed for e in self.tensors.values())

    @property
    def sparsity(self) -> float:
        total = self.total_elements
        return 1.0 - self.changed_elements / total if total else 1.0

    def to_strings(self) -> dict[str, str]:
        """The safetensors `__metadata__` (strings only), including TRL v1's keys for `coo`."""
        if self.state_digest is None:
            raise ValueError("files are written with their full-state digest")
        changed = [n for n, e in self.tensors.items() if e.changed]
        out = {
            "protocol": PROTOCOL,
            "run_id": self.run_id or "",
            "model_version": str(self.version),
            "kind": self.kind,
            "encoding": self.encoding,
            "digest_algorithm": DIGEST_ALGORITHM,
            "state_digest_algorithm": STATE_DIGEST_ALGORITHM,
            "state_digest": self.state_digest.hex(),
            "tensors": json.dumps(
                {n: [list(e.shape), e.digest, e.changed] for n, e in self.tensors.items()},
                separators=(",", ":"),
            ),
            "total_elements": str(self.total_elements),
            "total_changed_elements": str(self.changed_elements),
            "sparsity": f"{self.sparsity:.6f}",
            "num_changed_params": str(len(changed)),
        }
        if self.base_version is not None:
            out["base_version"] = str(self.base_version)
        if self.kind == "anchor":
            out["sparse"] = "False"
        else:
            out |= {"sparse": "True", "changed_params": json.dumps(changed)}
        spec = spec_of(self.encoding)
        out |= spec.metadata
        if not spec.holds_weights:  # it names where they are
            if self.source is None:
                raise ValueError(f"a {self.encoding} file names its model source")
            out["source"] = self.source.to_json()
        if self.part is not None:  # no loader may take one part for a whole checkpoint or patch
            rows = {n: list(r) for n, r in self.part.rows.items()}
            out |= {
                "format": "deltasync_part",
                "part_index": str(self.part.index),
                "part_count": str(self.part.count),
                "part_rows": json.dumps(rows, separators=(",", ":")),
            }
        return out

    @classmethod
    def from_header(cls, header: SafetensorsHeader, *, path: str | None = None) -> FileMetadata:
        """Parse and validate a file's metadata; a TRL v1 file also needs its tensor list."""
        meta = header.metadata
        if meta.get("format") == "sparse_weight_patch" and "protocol" not in meta:
            return _from_trl_v1(meta, header, path)
        return cls.from_strings(meta, path=path)

    @classmethod
    def from_strings(cls, meta: dict[str, str], *, path: str | None = None) -> FileMetadata:
        """Parse and validate our metadata; raises `FormatError` naming the key that is wrong."""
        protocol = check_protocol(meta.get("protocol"), what="file", path=path)
        if meta.get("digest_algorithm") != DIGEST_ALGORITHM:
            raise FormatError(f"unsupported digest {meta.get('digest_algorithm')!r}", path=path)
        state_digest = None
        if protocol >= 2:
            if meta.get("state_digest_algorithm") != STATE_DIGEST_ALGORITHM:
                algorithm = meta.get("state_digest_algorithm")
                raise FormatError(f"unsupported state digest {algorithm!r}", path=path)
            state_digest = StateDigest.parse(meta.get("state_digest"), path=path)
        kind = _choice(meta, "kind", ("anchor", "delta"), path)
        encoding_tag = _choice(meta, "encoding", tags(kind, protocol), path)
        version = _int(meta, "model_version", path, minimum=1)
        base = _int(meta, "base_version", path, minimum=0) if kind == "delta" else None
        if base is not None and base != version - 1:
            raise FormatError(
                f"base_version {base} is not model_version - 1 ({version - 1}): a delta goes "
                "from the version right before it",
                path=path,
            )
        run_id = validate_run_id(meta.get("run_id", ""), path=path)
        sharded = protocol >= 3 and "part_index" in meta
        tensors = _tensor_entries(meta, path, digests_optional=sharded)
        part = _part_info(meta, tensors, path) if sharded else None
        source = None
        if not spec_of(encoding_tag).holds_weights:
            if part is not None:
                raise FormatError(f"a {encoding_tag} anchor is never sharded", path=path)
            try:
                source = ModelSource.from_json(meta.get("source"))
            except FormatError as exc:
                raise FormatError(str(exc), path=path) from None
        return cls(
            run_id,
            version,
            base,
            kind,
            encoding_tag,
            tensors,
            state_digest=state_digest,
            part=part,
            source=source,
        )


def _choice(meta: dict[str, str], key: str, allowed: tuple[str, ...], path: str | None) -> str:
    value = meta.get(key)
    if value not in allowed:
        raise FormatError(f"metadata {key}={value!r}, expected one of {allowed}", path=path)
    return value


def _int(meta: dict[str, str], key: str, path: str | None, *, minimum: int) -> int:
    value = meta.get(key)
    if (
        value is None
        or not (value.isascii() and value.isdigit())  # str.isdigit accepts '²', int() does not
        or len(value) > len(str(_MAX_VERSION))
        or not minimum <= int(value) < _MAX_VERSION
    ):
        raise FormatError(f"metadata {key}={value!r} is not an integer >= {minimum}", path=path)
    return int(value)


def _part_info(meta: dict[str, str], tensors: dict[str, TensorEntry], path: str | None) -> PartInfo:
    """A part file's index, count and rows: every tensor, rows within its dim 0."""
    count = _int(meta, "part_count", path, minimum=2)
    index = _int(meta, "part_index", path, minimum=0)
    if count > MAX_PARTS or index >= count:
        raise FormatError(f"part {index} of {count} (at most {MAX_PARTS} parts)", path=path)
    try:
        raw = json.loads(meta.get("part_rows", ""))
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"metadata 'part_rows' is not JSON: {exc}", path=path) from None
    if not keys_exactly(raw, set(tensors)):
        raise FormatError("metadata 'part_rows' must name exactly the file's tensors", path=path)
    rows = {}
    for name, value in raw.items():
        shape = tensors[name].shape
        if not (
            isinstance(value, list)
            and len(value) == 2
            and all(is_int(v) for v in value)
            and len(shape) >= 1
            and 0 <= value[0] <= value[1] <= shape[0]
        ):
            raise FormatError(f"bad rows {value!r} for shape {shape}", path=path, tensor=name)
        rows[name] = (value[0], value[1])
    part = PartInfo(index, count, rows)
    for name, entry in tensors.items():
        lo, hi = part.flat_range(name, entry.shape)
        if entry.changed > hi - lo:
            raise FormatError(
                f"changed={entry.changed} exceeds the part's {hi - lo} elements",
                path=path,
                tensor=name,
            )
    return part


def _tensor_entries(
    meta: dict[str, str], path: str | None, *, digests_optional: bool = False
) -> dict[str, TensorEntry]:
    try:
        raw = json.loads(meta.get("tensors", ""))
    except (ValueError, RecursionError) as exc:  # also too deep or a number too long to parse
        raise FormatError(f"metadata 'tensors' is not JSON: {exc}", path=path) from None
    if not isinstance(raw, dict):
        raise FormatError("metadata 'tensors' must be a JSON object", path=path)
    entries = {}
    for name, value in raw.items():
        if not (
            isinstance(value, list)
            and len(value) == 3
            and isinstance(value[0], list)
            and all(is_int(d, minimum=0, maximum=2**50 - 1) for d in value[0])
            and (
                (isinstance(value[1], str) and _HEX128.fullmatch(value[1]))
                or (digests_optional and value[1] is None)  # a part cannot hash whole tensors
            )
            and is_int(value[2])
        ):
            raise FormatError(f"bad tensor entry {value!r}", path=path, tensor=name)
        entry = TensorEntry(tuple(value[0]), value[1], value[2])
        if not 0 <= entry.changed <= entry.numel:
            raise FormatError(
                f"changed={entry.changed} outside 0..{entry.numel}", path=path, tensor=name
            )
        entries[name] = entry
    return entries


def _from_trl_v1(meta: dict[str, str], header: SafetensorsHeader, path: str | None) -> FileMetadata:
    """A file written by TRL PR #5417: no run, base or digests; counts from its header.

    An anchor lists every tensor with its shape. A delta holds only the changed tensors, without
    their full shapes: its `tensors` stay empty until the replica normalises the file against its
    own state; `declared` holds the file's `total_elements` and the changed count of its header.
    """
    version = _int(meta, "model_version", path, minimum=0)
    sparse = meta.get("sparse")
    if sparse not in ("True", "False"):
        raise FormatError(f"metadata sparse={sparse!r}, expected 'True' or 'False'", path=path)
    if sparse == "False":
        tensors = {n: TensorEntry(t.shape, None, t.numel) for n, t in header.tensors.items()}
        return FileMetadata(None, version, None, "anchor", "full", tensors, legacy=True)
    changed = sum(t.numel for n, t in header.tensors.items() if n.endswith(".indices"))
    total = _int(meta, "total_elements", path, minimum=0) if "total_elements" in meta else 0
    declared = (max(total, changed), changed)
    return FileMetadata(None, version, None, "delta", "coo", {}, True, declared)


@dataclass(frozen=True)
class ParsedFile:
    """A file's bytes with its header and metadata parsed once; every later stage reads these."""

    data: bytes
    header: SafetensorsHeader
    meta: FileMetadata
    path: str | None = None

    @classmethod
    def parse(
        cls, data: bytes, *, path: str | None = None, tensors: int | None = None
    ) -> ParsedFile:
        """Bounded header parse (by `tensors`, the reader's model's tensor count, when known),
        then typed metadata; raises `FormatError`, reads no tensor."""
        header = parse_header_bytes(data, path=path, tensors=tensors)
        return cls(data, header, FileMetadata.from_header(header, path=path), path)

    def normalised(
        self, run_id: str | None, version: int | None, shapes: dict[str, tuple[int, ...]]
    ) -> ParsedFile:
        """A TRL v1 file as if it were ours: it follows (`run_id`, `version`), the reader's state.

        The one place legacy files are made whole: a delta gets the reader's shapes for the
        tensors it changes; digests stay None, so there is nothing to verify. Other files are
        returned unchanged.
        """
        meta = self.meta
        if not meta.legacy:
            return self
        tensors = meta.tensors
        if meta.kind == "delta":
            counts = {
                n[: -len(".indices")]: t.numel
                for n, t in self.header.tensors.items()
                if n.endswith(".indices")
            }
            unknown = sorted(set(counts) - set(shapes))
            if unknown:
                raise FormatError(
                    f"TRL v1 delta changes tensors the reader does not hold: {unknown[:5]}",
                    path=self.path,
                )
            tensors = {n: TensorEntry(shape, None, counts.get(n, 0)) for n, shape in shapes.items()}
        base = version if meta.kind == "delta" else None
        fields = {"run_id": run_id, "base_version": base, "tensors": tensors, "declared": None}
        return replace(self, meta=replace(meta, **fields))


def check_tiling(
    shapes: dict[str, tuple[int, ...]], rows: Sequence[dict[str, tuple[int, int]]]
) -> None:
    """The parts' rows, in part order, must tile dim 0 of every tensor (a part may hold none:
    an empty range where the previous one ends)."""
    for name, shape in shapes.items():
        edges = [tuple(r.get(name, (-1, -1))) for r in rows]
        starts = [start for start, _ in edges]
        stops = [stop for _, stop in edges]
        if not shape or starts != [0, *stops[:-1]] or stops[-1] != shape[0]:
            raise FormatError(f"parts' rows {edges} do not tile dim 0 of {shape}", tensor=name)


class HeadedFile(Protocol):
    """A file whose header was parsed and checked: one read whole (`ParsedFile`) or one read
    in pieces as it is consumed (`wire.stored.StoredFile`)."""

    header: SafetensorsHeader
    meta: FileMetadata
    path: str | None


@dataclass(frozen=True)
class ParsedParts:
    """The part files of one sharded version, checked to fit together.

    `meta` describes the whole version as one file would: the tensors' changed counts summed,
    no per-tensor digests (no part holds a whole tensor), and the parts' full-state digests
    added up into the version's. `path` labels the version in errors.
    """

    parts: tuple[HeadedFile, ...]
    meta: FileMetadata
    path: str | None = None

    @classmethod
    def of(cls, parts: Sequence[HeadedFile], *, path: str | None = None) -> ParsedParts:
        """Check that `parts` are every part of one version, in index order, and that their
        rows tile every tensor; raises `FormatError` naming what does not fit."""
        path = path or (parts[0].path if parts else None)
        metas = [p.meta for p in parts]
        if not metas or any(m.part is None for m in metas):
            raise FormatError("a sharded version is read from its part files only", path=path)
        first = metas[0]
        count = first.part.count  # type: ignore[union-attr]
        found = [m.part.index for m in metas]  # type: ignore[union-attr]
        if found != list(range(count)) or any(m.part.count != count for m in metas):  # type: ignore[union-attr]
            raise FormatError(f"parts {found} are not parts 0..{count - 1} in order", path=path)
        same = ("run_id", "version", "base_version", "kind", "encoding")
        shapes = {n: e.shape for n, e in first.tensors.items()}
        for meta in metas[1:]:
            differs = [k for k in same if getattr(meta, k) != getattr(first, k)]
            if differs or {n: e.shape for n, e in meta.tensors.items()} != shapes:
                raise FormatError(
                    f"part {meta.part.index} disagrees with part 0 on "  # type: ignore[union-attr]
                    f"{differs or ['tensors']}",
                    path=path,
                )
        try:
            check_tiling(shapes, [m.part.rows for m in metas])  # type: ignore[union-attr]
        except FormatError as exc:
            raise FormatError(str(exc), path=path, tensor=exc.tensor) from None
        tensors = {
            n: TensorEntry(e.shape, None, sum(m.tensors[n].changed for m in metas))
            for n, e in first.tensors.items()
        }
        state_digest = total(m.state_digest for m in metas)  # type: ignore[arg-type]
        meta = replace(first, tensors=tensors, state_digest=state_digest, part=None)
        return cls(tuple(parts), meta, path)


def read_metadata(
    read: Callable[[int, int], bytes],
    file_size: int | None,
    *,
    path: str | None = None,
    tensors: int | None = None,
) -> tuple[FileMetadata, SafetensorsHeader]:
    """Metadata from the header alone (byte-range reads), as the dashboard and `inspect` need."""
    header = parse_header(read, file_size, path=path, tensors=tensors)
    return FileMetadata.from_header(header, path=path), header
