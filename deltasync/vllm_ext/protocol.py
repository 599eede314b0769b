"""Control messages of the `deltasync` weight-transfer backend and of the sync route: the wire
between the trainer's client, the server and the workers, so each imports it and none another.

vLLM hands the engine plain dicts (`init_info`, `update_info`, `/collective_rpc` strings) and the
sync route hands it JSON bodies; they become these frozen records in one place and are validated
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltasync import defaults
from deltasync.errors import FormatError, StoreError
from deltasync.store import validate_path
from deltasync.wire.fields import is_int
from deltasync.wire.manifest import MAX_MANIFEST_BYTES

__all__ = [
    "SYNC_PATH",
    "InitInfo",
    "SyncRequest",
    "UpdateInfo",
    "merge_statuses",
    "parse_message",
    "parse_version",
    "stage_args",
    "stage_manifest",
]

SYNC_PATH = "/deltasync/sync"  # the one route that changes weights (`server.control`)
MAX_VERSION = 2**63 - 1  # versions travel as int64 in file metadata
MAX_PATH_CHARS = 1024


def _shown(value: object) -> str:
    """`value` for an error message: its repr, cut short (messages never echo long input)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_version(value: object, *, what: str = "version") -> int:
    """A version: a JSON integer, or a `/collective_rpc` string of ASCII digits (not "٢", not
    "²", no sign, no spaces), from 1 to 2**63 - 1."""
    if isinstance(value, str):
        if not (0 < len(value) <= 19 and value.isascii() and value.isdigit()):
            raise FormatError(f"{what} must be ASCII digits 0-9, got {_shown(value)}")
        value = int(value)
    if not is_int(value, minimum=1, maximum=MAX_VERSION):
        raise FormatError(f"{what} must be an integer from 1 to 2**63-1, got {_shown(value)}")
    return value


def _bucket_path(value: object, what: str) -> str:
    """A file path inside the bucket (a string that `validate_path` accepts)."""
    if not isinstance(value, str):
        raise FormatError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > MAX_PATH_CHARS:
        raise FormatError(f"{what} must be at most {MAX_PATH_CHARS} characters, got {len(value)}")
    try:
        return validate_path(value)
    except StoreError as exc:  # report it as a bad message
        raise FormatError(f"{what}: {exc}") from None


def stage_args(version: object, path: object = "") -> tuple[int, str | None]:
    """`deltasync_stage` / `deltasync_apply` string arguments (vLLM passes `/collective_rpc`
    kwargs through untyped): (version, path or None); FormatError before any slot is touched."""
    if not isinstance(version, str):
        raise FormatError(f"version must be a string of ASCII digits, got {type(version).__name__}")
    number = parse_version(version)
    if not isinstance(path, str):
        raise FormatError(f"path must be a string, got {type(path).__name__}")
    return number, (_bucket_path(path, "path") if path else None)


def stage_manifest(manifest: object) -> bytes | None:
    """`deltasync_stage`'s `manifest`: the manifest bytes a follower's poll read (in process
    only: `control.ControlPlane.rpc` refuses the key over HTTP), at most `MAX_MANIFEST_BYTES`,
    or None (the engine reads the manifest itself)."""
    if manifest is None:
        return None
    if not isinstance(manifest, bytes):
        raise FormatError(f"manifest must be bytes, got {type(manifest).__name__}")
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest of {len(manifest)} bytes exceeds {MAX_MANIFEST_BYTES}")
    return manifest


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
        recompute_every: recompute the full-state digest over the served weights (while
            serving) every this many versions, which catches bytes that changed without a
            delta; 0: only at anchors.
    """

    bucket: str
    verify: bool = True
    allow_legacy: bool = False
    prepack: bool = True
    recompute_every: int = defaults.RECOMPUTE_EVERY

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket.strip():
            raise FormatError(f"init_info.bucket must be a store URL, got {self.bucket!r}")
        for name in ("verify", "allow_legacy", "prepack"):
            if not isinstance(getattr(self, name), bool):
                raise FormatError(f"init_info.{name} must be true or false")
        every = self.recompute_every
        if not is_int(every, minimum=0, maximum=10**6):
            raise FormatError(
                f"init_info.recompute_every must be an integer 0..1000000, got {every!r}"
            )


@dataclass(frozen=True)
class UpdateInfo:
    """`POST /update_weights {"update_info": {"version": 7, "path": "runs/..."}}`.

    Attributes:
        version: the version to serve once the update finishes; the replica reaches it from
            the staged file, or by replaying the bucket's chain when it is further behind.
        path: the file the trainer notified (optional); it must be the manifest's file for
            `version`. When it is the delta after the version held, staging reads it beside
            the manifest (one round trip; `replica.driven`).
    """

    version: int
    path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", parse_version(self.version, what="update_info.version"))
        if self.path is not None:
            _bucket_path(self.path, "update_info.path")


@dataclass(frozen=True)
class SyncRequest:
    """`POST /deltasync/sync {"version": 7, "path": "runs/..."}`: the one request that changes
    a replica's weights (stage, pause, apply, verify, record, resume; see `control`).

    Attributes:
        version: the version to serve, a JSON integer (a string, float or bool is refused);
            the replica reaches it from what it holds by the bucket's chain.
        path: as in `UpdateInfo`.
    """

    version: int
    path: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.version):
            raise FormatError(f"version must be a JSON integer, got {_shown(self.version)}")
        parse_version(self.version)
        if self.path is not None:
            _bucket_path(self.path, "path")


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


def merge_statuses(results: list[Any]) -> dict[str, Any]:
    """One `deltasync_status` from every worker's: the first worker's, with `staging` and `busy`
    merged (tensor-parallel workers stage in parallel: a version is ready once every worker has
    it ready, failed once one failed; busy while one still stages), `bytes_read` listing
    what each worker read from the bucket and `last_read` what each read for the last update.
    Raises FormatError when a
    worker sent no status or the workers disagree on the run, version or digest they hold."""
    if not results or not all(
        isinstance(r, dict) and isinstance(r.get("staging"), dict) for r in results
    ):
        raise FormatError(f"workers sent no status: {str(results)[:300]}")
    first = results[0]
    for key in ("run_id", "version", "state_digest"):
        if any(r.get(key) != first.get(key) for r in results[1:]):
            raise FormatError(f"workers disagree on {key}: {[r.get(key) for r in results]}")
    staging = {}
    for version in {v for r in results for v in r["staging"]}:
        states = [str(r["staging"].get(version, "missing")) for r in results]
        staging[version] = next(
            (s for s in states if s.startswith("failed")),
            next((s for s in states if s != "ready"), "ready"),
        )
    busy = any(r.get("busy") for r in results)
    read = [r.get("bytes_read") for r in results]  # each worker reads its own boxes
    last = [(r.get("last_update") or {}).get("bytes_read") for r in results]
    return first | {"staging": staging, "busy": busy, "bytes_read": read, "last_read": last}
