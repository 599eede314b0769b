"""Control messages of the `deltasync` weight-transfer backend and the catch-up plan to a version.

vLLM hands the engine plain dicts (`init_info`, `update_info`, `/collective_rpc` strings); they
become these frozen records in one place and are validated there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ChainError, FormatError
from ..manifest import ChainEntry, Manifest
from ..store import validate_path

__all__ = ["InitInfo", "UpdateInfo", "parse_message", "parse_version", "plan_to"]


def parse_version(value: object, *, what: str = "version") -> int:
    """A version from JSON or a `/collective_rpc` string argument: a positive integer."""
    if isinstance(value, bool):
        raise FormatError(f"{what} must be a positive integer, got {value!r}")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or value < 1:
        raise FormatError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class InitInfo:
    """`POST /init_weight_transfer_engine {"init_info": {...}}`.

    Credentials are never part of the request: the store reads them from the server's
    environment (HF_TOKEN, AWS_*, ...), like any fsspec backend.

    Attributes:
        bucket: store URL (`hf://buckets/NS/NAME`, `s3://...`, a folder, ...).
        verify: check every tensor digest before the served weights change (GPU path: one
            device-to-host copy of each touched tensor while still serving).
        allow_legacy: accept TRL v1 files, which carry no run, base or digests.
        prepack: CPU path: pack touched modules while serving so the pause only swaps them in
            (needs memory for one more copy of the touched weights); false reloads them in the
            pause. Can be changed by calling init again.
    """

    bucket: str
    verify: bool = True
    allow_legacy: bool = False
    prepack: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket.strip():
            raise FormatError(f"init_info.bucket must be a store URL, got {self.bucket!r}")
        for name in ("verify", "allow_legacy", "prepack"):
            if not isinstance(getattr(self, name), bool):
                raise FormatError(f"init_info.{name} must be true or false")


@dataclass(frozen=True)
class UpdateInfo:
    """`POST /update_weights {"update_info": {"version": 7, "path": "runs/..."}}`.

    Attributes:
        version: the version to serve once the update finishes; the replica reaches it from
            the staged file, or by replaying the bucket's chain when it is further behind.
        path: the file the trainer notified (optional); it must be the manifest's file for
            `version`.
    """

    version: int
    path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", parse_version(self.version, what="update_info.version"))
        if self.path is not None:
            try:
                validate_path(self.path)
            except Exception as exc:  # StoreError: report it as a bad message
                raise FormatError(f"update_info.path: {exc}") from None


def parse_message(cls: type, raw: Any, what: str) -> Any:
    """A record from a JSON object; unknown keys (a token, storage options, ...) are refused.

    Raises `ValueError` (vLLM answers it as a bad request) naming the expected keys.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(raw).__name__}")
    fields = set(cls.__dataclass_fields__)
    if unknown := sorted(set(raw) - fields):
        raise ValueError(f"unknown {what} keys {unknown}; expected {sorted(fields)}")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise ValueError(f"invalid {what}: {exc}") from None


def plan_to(
    manifest: Manifest, run_id: str | None, version: int | None, target: int
) -> list[ChainEntry]:
    """Files a reader at (`run_id`, `version`) applies, in order, to reach exactly `target`.

    Like `Manifest.catch_up_plan`, but stops at `target` (a notification can trail the manifest):
    replays deltas when the reader is inside the chain and that is cheaper, otherwise starts from
    the newest retained anchor at or before `target`.

    Raises:
        ChainError: the bucket cannot produce `target` for this reader (too new, pruned, or the
            reader is already past it).
    """
    if target > manifest.latest_version:
        raise ChainError(
            f"version {target} is not in the bucket yet (latest {manifest.latest_version})",
            expected=manifest.latest_version,
            found=target,
        )
    same_run = run_id == manifest.run_id and version is not None
    if same_run and version == target:
        return []
    if same_run and version > target:
        raise ChainError(
            f"replica serves version {version}, past the requested {target}",
            expected=target,
            found=version,
        )
    routes = []
    if same_run:
        routes.append(_deltas(manifest, version, target))
    anchors = [a for a in manifest.anchors if a.version <= target]
    if anchors:
        anchor = max(anchors, key=lambda a: a.version)
        tail = _deltas(manifest, anchor.version, target)
        routes.append(None if tail is None else [anchor, *tail])
    routes = [r for r in routes if r is not None]
    if not routes:
        raise ChainError(
            f"the bucket no longer holds a route to version {target} (retained anchors "
            f"{[a.version for a in manifest.anchors]}, deltas from "
            f"{manifest.deltas[0].version if manifest.deltas else '-'})",
            expected=target,
            found=None,
        )
    return min(routes, key=lambda r: sum(e.bytes for e in r))


def _deltas(manifest: Manifest, after: int, target: int) -> list[ChainEntry] | None:
    """The contiguous deltas after..target, or None if the chain does not cover them."""
    deltas = [d for d in manifest.deltas if after < d.version <= target]
    if [d.version for d in deltas] != list(range(after + 1, target + 1)):
        return None
    return deltas
