"""The metrics record of one committed version (`runs/<run>/metrics/<version>.json`).

Written once per version by exactly one writer, the publisher or the trainer's weight transfer
(which writer, and every key: bucket_layout.md, "Metrics record"); readers (the dashboard,
`launch.py --local`'s summary) parse it with `SyncRecord.from_json`. Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from deltasync.errors import FormatError
from deltasync.wire.fields import is_int, is_number, keys_exactly

__all__ = ["KINDS", "MAX_RECORD_BYTES", "ReplicaOutcome", "SyncRecord"]

MAX_RECORD_BYTES = 1024 * 1024
MAX_REPLICAS = 1024
MAX_ERROR_CHARS = 2000
KINDS = ("anchor", "delta", "delta+anchor")


@dataclass(frozen=True)
class ReplicaOutcome:
    """One rollout replica's sync to one version, as the trainer saw it.

    Attributes:
        name: the replica (`vllm-0`, ...); the key of the record's `replicas` object.
        ok: it reported the version (and matching digests when checked) within `attempts`.
        attempts: tries made (>= 1).
        stage_s: download + decode + validate while serving (0 when it failed).
        pause_s: inference paused for apply + verify (0 when it failed).
        total_s: from the first try to the outcome, as the trainer measured it.
        error: the last failure's message, or None.
        latency_s: commit-to-serving latency: from the trainer's `publish()` of this version
            until the replica served it or a newer version (None: not measured - it failed, or
            an older record).
        served_version: the version it served when first seen at or past this one; above this
            record's version, a driven replica was synced straight to that newer version (this
            one was superseded: nothing was applied for it, its pause is 0).
        following: a follower (`serve --follow`): it syncs itself, the trainer only polls its
            served version, so `latency_s` is bounded by the poll interval and there is no
            stage or pause.
    """

    name: str
    ok: bool
    attempts: int
    stage_s: float = 0.0
    pause_s: float = 0.0
    total_s: float = 0.0
    error: str | None = None
    latency_s: float | None = None
    served_version: int | None = None
    following: bool = False

    def __post_init__(self) -> None:
        what = f"replicas[{self.name!r}]"
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 128:
            raise FormatError(f"replica name {self.name!r} must be a string of 1-128 characters")
        _check(isinstance(self.ok, bool), f"{what}.ok", self.ok, "true or false")
        _check(is_int(self.attempts, minimum=1), f"{what}.attempts", self.attempts)
        for key in ("stage_s", "pause_s", "total_s"):
            object.__setattr__(self, key, _seconds(getattr(self, key), f"{what}.{key}"))
        if self.error is not None:
            _check(isinstance(self.error, str), f"{what}.error", self.error, "a string or null")
            object.__setattr__(self, "error", self.error[:MAX_ERROR_CHARS])
        if self.latency_s is not None:
            object.__setattr__(self, "latency_s", _seconds(self.latency_s, f"{what}.latency_s"))
        if self.served_version is not None:
            _check(
                is_int(self.served_version, minimum=1),
                f"{what}.served_version",
                self.served_version,
                ">= 1",
            )
        _check(
            isinstance(self.following, bool), f"{what}.following", self.following, "true or false"
        )

    def superseded(self, version: int) -> bool:
        """Whether this driven replica went straight past `version` (its record's) to a newer
        one: nothing was applied for `version`, the pause is counted at the newer one's."""
        served = self.served_version
        return not self.following and served is not None and served > version

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}


@dataclass(frozen=True)
class SyncRecord:
    """One committed version: what the publisher did, and (optionally) what the trainer saw.

    Every key's type, unit and meaning: bucket_layout.md, "Metrics record". Publisher fields
    are always set; the trainer fields (`replicas`, `sync_s`, `step`, `reward_mean`) are empty or
    null when the publisher wrote the record alone.
    """

    run_id: str
    version: int
    kind: str
    encoding: str
    delta_path: str | None
    anchor_path: str | None
    delta_bytes: int
    anchor_bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int
    sparsity: float
    diff_s: float
    encode_s: float
    upload_s: float
    queued_s: float
    committed_at: float
    replicas: tuple[ReplicaOutcome, ...] = ()
    sync_s: float | None = None
    step: int | None = None
    reward_mean: float | None = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.run_id, str) and 0 < len(self.run_id) <= 64,
            "run_id",
            self.run_id,
            "a string of 1-64 characters",
        )
        _check(is_int(self.version, minimum=1), "version", self.version, ">= 1")
        _check(self.kind in KINDS, "kind", self.kind, f"one of {list(KINDS)}")
        _check(isinstance(self.encoding, str) and self.encoding, "encoding", self.encoding, "text")
        for key, kind in (("delta_path", "delta"), ("anchor_path", "anchor")):
            value, wanted = getattr(self, key), kind in self.kind.split("+")
            ok = isinstance(value, str) and value != "" if wanted else value is None
            _check(ok, key, value, f"{'a path' if wanted else 'null'} for kind {self.kind}")
        for key in ("delta_bytes", "anchor_bytes", "full_bytes", "changed_elements"):
            _check(is_int(getattr(self, key), minimum=0), key, getattr(self, key))
        _check(
            is_int(self.total_elements) and self.total_elements >= self.changed_elements,
            "total_elements",
            self.total_elements,
            f">= changed_elements ({self.changed_elements})",
        )
        sparsity = _number(self.sparsity, "sparsity")
        _check(0.0 <= sparsity <= 1.0, "sparsity", sparsity, "between 0 and 1")
        object.__setattr__(self, "sparsity", sparsity)
        for key in ("diff_s", "encode_s", "upload_s", "queued_s"):
            object.__setattr__(self, key, _seconds(getattr(self, key), key))
        object.__setattr__(self, "committed_at", _number(self.committed_at, "committed_at"))
        self._check_trainer_fields()

    def _check_trainer_fields(self) -> None:
        replicas = self.replicas
        _check(
            isinstance(replicas, tuple) and all(isinstance(r, ReplicaOutcome) for r in replicas),
            "replicas",
            replicas,
            "a tuple of ReplicaOutcome",
        )
        _check(len(replicas) <= MAX_REPLICAS, "replicas", f"{len(replicas)} entries", "fewer")
        names = [r.name for r in replicas]
        _check(len(set(names)) == len(names), "replicas", names, "distinct names")
        if self.sync_s is not None:
            object.__setattr__(self, "sync_s", _seconds(self.sync_s, "sync_s"))
        if self.step is not None:
            _check(is_int(self.step, minimum=0), "step", self.step)
        if self.reward_mean is not None:  # TRL logs NaN when no sample of the step had a reward
            reward = _number(self.reward_mean, "reward_mean", finite=False)
            object.__setattr__(self, "reward_mean", reward if math.isfinite(reward) else None)

    @property
    def has_delta(self) -> bool:
        return self.delta_path is not None

    @property
    def has_anchor(self) -> bool:
        return self.anchor_path is not None

    def with_sync(
        self,
        replicas: tuple[ReplicaOutcome, ...],
        *,
        sync_s: float,
        step: int | None,
        reward_mean: float | None,
    ) -> SyncRecord:
        """This record completed by the trainer (validated again)."""
        return replace(
            self, replicas=tuple(replicas), sync_s=sync_s, step=step, reward_mean=reward_mean
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: every key always present; `replicas` as `{name: outcome}`."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["replicas"] = {r.name: r.to_dict() for r in self.replicas}
        return out

    def to_json(self) -> bytes:
        data = json.dumps(self.to_dict(), allow_nan=False).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise FormatError(f"metrics record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def from_json(cls, data: bytes, *, path: str | None = None) -> SyncRecord:
        """Parse and validate one record; raises `FormatError` for anything unexpected.

        The publisher's keys are required; the trainer's may be missing (records the publisher
        wrote alone); any other key is refused.
        """
        if len(data) > MAX_RECORD_BYTES:
            raise FormatError(
                f"metrics record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}", path=path
            )
        try:
            raw = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # also bad UTF-8, NaN, too deep
            raise FormatError(f"metrics record is not JSON: {exc}", path=path) from None
        if not isinstance(raw, dict):
            raise FormatError(f"metrics record is a {type(raw).__name__}, not an object", path=path)
        expected = sorted((*_PUBLISHER_KEYS, *_TRAINER_KEYS))
        unknown = sorted(set(raw) - set(expected))
        missing = sorted(set(_PUBLISHER_KEYS) - set(raw))
        if unknown or missing:
            found = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
            raise FormatError(f"metrics record has {found}; expected {expected}", path=path)
        try:
            replicas = _parse_replicas(raw.get("replicas"))
            return cls(**{**raw, "replicas": replicas})
        except FormatError as exc:
            raise FormatError(str(exc), path=path) from None

    def log_lines(self, bucket: str) -> list[str]:
        """The design's per-sync log lines: what changed, then each uploaded file."""
        lines = [
            f"Delta: {self.changed_elements}/{self.total_elements} elements changed "
            f"(sparsity={100 * self.sparsity:.2f}%)"
        ]
        files = ((self.delta_path, self.delta_bytes), (self.anchor_path, self.anchor_bytes))
        for path, size in files:
            if path:
                shown = f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} KB"
                lines.append(
                    f"uploaded {bucket.rstrip('/')}/{path} ({shown}, "
                    f"{self.full_bytes / max(size, 1):.1f}x smaller than full bf16, "
                    f"encode {self.encode_s:.2f}s, upload {self.upload_s:.2f}s)"
                )
        return lines


_LATENCY_KEYS = ("latency_s", "served_version", "following")
_TRAINER_KEYS = ("replicas", "sync_s", "step", "reward_mean")
_PUBLISHER_KEYS = tuple(f.name for f in fields(SyncRecord) if f.name not in _TRAINER_KEYS)


def _parse_replicas(raw: Any) -> tuple[ReplicaOutcome, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise FormatError(f"metrics replicas must be an object of replicas, got {raw!r:.80}")
    if len(raw) > MAX_REPLICAS:
        raise FormatError(f"metrics replicas has {len(raw)} entries, at most {MAX_REPLICAS}")
    expected = sorted(f.name for f in fields(ReplicaOutcome) if f.name != "name")
    outcomes = []
    for name, outcome in raw.items():
        # records written before latency was measured lack exactly the latency keys
        old = set(expected) - set(_LATENCY_KEYS)
        if not (keys_exactly(outcome, set(expected)) or keys_exactly(outcome, old)):
            found = sorted(outcome) if isinstance(outcome, dict) else type(outcome).__name__
            raise FormatError(f"metrics replicas[{name!r}] has keys {found}; expected {expected}")
        outcomes.append(ReplicaOutcome(name=name, **outcome))
    return tuple(outcomes)


def _check(ok: object, key: str, value: Any, expected: str = "a non-negative integer") -> None:
    if not ok:
        raise FormatError(f"metrics {key}={value!r:.80} must be {expected}")


def _number(value: Any, key: str, *, finite: bool = True) -> float:
    _check(is_number(value, finite=finite), key, value, "a finite number")
    return float(value)


def _seconds(value: Any, key: str) -> float:
    seconds = _number(value, key)
    _check(seconds >= 0, key, value, "seconds >= 0")
    return seconds


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
