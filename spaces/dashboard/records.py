"""Typed views of what the dashboard reads: metrics records and safetensors headers.

Raw JSON and header strings become frozen dataclasses here, in one parse function each; the
rest of the dashboard never sees raw dicts (STYLE 4).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from deltasync.codec import read_metadata
from deltasync.errors import FormatError
from deltasync.manifest import ChainEntry
from deltasync.store import Store

__all__ = ["HeaderInfo", "MetricsRecord", "ReplicaTiming", "read_header"]

MAX_METRICS_BYTES = 1024 * 1024
_REPLICA_KEYS = ("replicas", "replica_timings")
_REWARD_KEYS = ("reward_mean", "reward")
_STEP_KEYS = ("step", "global_step")


@dataclass(frozen=True)
class ReplicaTiming:
    """One replica's seconds for one sync, e.g. {"stage": 0.2, "pause": 0.01, "apply": 0.01}."""

    name: str
    seconds: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class MetricsRecord:
    """A `runs/<run>/metrics/<version>.json` record (a `SyncRecord`, plus optional extras).

    Fields a trainer may add later (`replicas`, `reward_mean`, `step`) are optional; unknown
    fields are ignored so that newer trainers keep working with this dashboard.
    """

    version: int
    kind: str
    encoding: str
    delta_bytes: int
    anchor_bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int
    sparsity: float | None
    encode_s: float | None
    upload_s: float | None
    committed_at: float | None
    replicas: tuple[ReplicaTiming, ...] = ()
    reward: float | None = None
    step: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def has_delta(self) -> bool:
        return "delta" in self.kind.split("+")

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> MetricsRecord:
        """Parse one record; raises `FormatError` when its core fields are unusable.

        Malformed optional extras do not discard the record: they are left out and named in
        `notes`, which the dashboard lists as problems.
        """
        if len(data) > MAX_METRICS_BYTES:
            raise FormatError(f"metrics record of {len(data)} bytes is too large", path=path)
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"metrics record is not JSON: {exc}", path=path) from None
        if not isinstance(raw, dict):
            raise FormatError("metrics record is not a JSON object", path=path)
        version = _int(raw, "version", path, required=True)
        if version < 1:
            raise FormatError(f"metrics version {version} must be >= 1", path=path)
        notes: list[str] = []
        replicas = _replicas(raw, notes)
        return cls(
            version=version,
            kind=_str(raw, "kind", path) or "delta",
            encoding=_str(raw, "encoding", path) or "",
            delta_bytes=_int(raw, "delta_bytes", path),
            anchor_bytes=_int(raw, "anchor_bytes", path),
            full_bytes=_int(raw, "full_bytes", path),
            changed_elements=_int(raw, "changed_elements", path),
            total_elements=_int(raw, "total_elements", path),
            sparsity=_float(raw, "sparsity", path),
            encode_s=_float(raw, "encode_s", path),
            upload_s=_float(raw, "upload_s", path),
            committed_at=_float(raw, "committed_at", path),
            replicas=replicas,
            reward=_first_float(raw, _REWARD_KEYS, notes),
            step=_first_step(raw, notes),
            notes=tuple(f"{path}: {n}" for n in notes),
        )


@dataclass(frozen=True)
class HeaderInfo:
    """What one anchor or delta header says, read with two byte-range requests."""

    version: int
    kind: str
    encoding: str
    total_elements: int
    changed_elements: int
    sparsity: float
    header_bytes: int


def read_header(store: Store, entry: ChainEntry, run_id: str) -> HeaderInfo:
    """The header of a manifest entry: `size`, then bytes [0, 8) and [8, 8 + n) only.

    Raises:
        MissingFile: the manifest names a file the bucket does not list (yet).
        FormatError: the file is corrupt or disagrees with the manifest.
        StoreError: the bucket could not be read.
    """
    size = store.size(entry.path)
    if size != entry.bytes:
        raise FormatError(f"file is {size} bytes, the manifest says {entry.bytes}", path=entry.path)
    meta, header = read_metadata(
        lambda start, end: store.get_range(entry.path, start, end), size, path=entry.path
    )
    found = (meta.version, meta.kind, meta.run_id)
    if found != (entry.version, entry.kind, run_id):
        raise FormatError(
            f"header says version {meta.version} {meta.kind} of run {meta.run_id!r}, "
            f"the manifest says version {entry.version} {entry.kind} of run {run_id!r}",
            path=entry.path,
        )
    if meta.kind == "anchor":  # an anchor holds every element; its sparsity is meaningless
        changed = total = meta.total_elements
    else:
        changed, total = meta.changed_elements, meta.total_elements
    return HeaderInfo(
        version=meta.version,
        kind=meta.kind,
        encoding=meta.encoding,
        total_elements=total,
        changed_elements=changed,
        sparsity=meta.sparsity if meta.kind == "delta" else 0.0,
        header_bytes=header.data_offset,
    )


def _int(raw: dict[str, Any], key: str, path: str, *, required: bool = False) -> int:
    value = raw.get(key)
    if value is None and not required:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"metrics {key}={value!r} is not a non-negative integer", path=path)
    return value


def _float(raw: dict[str, Any], key: str, path: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise FormatError(f"metrics {key}={value!r} is not a number", path=path)
    return float(value) if math.isfinite(value) else None


def _str(raw: dict[str, Any], key: str, path: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise FormatError(f"metrics {key}={value!r} is not a string", path=path)
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _first_float(raw: dict[str, Any], keys: tuple[str, ...], notes: list[str]) -> float | None:
    for key in keys:
        if raw.get(key) is not None:
            value = _number(raw[key])
            if value is None:
                notes.append(f"{key}={raw[key]!r} is not a finite number")
            return value
    return None


def _first_step(raw: dict[str, Any], notes: list[str]) -> int | None:
    for key in _STEP_KEYS:
        value = raw.get(key)
        if value is not None:
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
            notes.append(f"{key}={value!r} is not a non-negative integer")
            return None
    return None


def _replicas(raw: dict[str, Any], notes: list[str]) -> tuple[ReplicaTiming, ...]:
    """`{"name": {"stage_s": 0.2, ...}}` or `[{"name": "r0", "stage_s": 0.2, ...}]`."""
    key = next((k for k in _REPLICA_KEYS if raw.get(k) is not None), None)
    if key is None:
        return ()
    value = raw[key]
    if isinstance(value, list) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
    ):
        value = {v["name"]: v for v in value}
    if not isinstance(value, dict):
        notes.append(f"{key} is neither an object of replicas nor a list of named replicas")
        return ()
    timings = []
    for name, fields in list(value.items())[:64]:
        if not isinstance(fields, dict):
            notes.append(f"{key}[{name!r}] is not an object")
            continue
        seconds = tuple(
            (field[:-2], number)
            for field, raw_value in fields.items()
            if isinstance(field, str)
            and field.endswith("_s")
            and (number := _number(raw_value)) is not None
        )
        if seconds:
            timings.append(ReplicaTiming(str(name), seconds))
    return tuple(timings)
