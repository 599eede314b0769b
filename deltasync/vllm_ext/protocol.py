"""Control messages of the `deltasync` weight-transfer backend.

vLLM hands the engine plain dicts (`init_info`, `update_info`, `/collective_rpc` strings); they
become these frozen records in one place and are validated there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..store import validate_path

__all__ = ["InitInfo", "UpdateInfo", "parse_message", "parse_version"]


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
        recompute_every: recompute the full-state digest over the served weights (while
            serving) every this many versions, which catches bytes that changed without a
            delta; 0: only at anchors.
    """

    bucket: str
    verify: bool = True
    allow_legacy: bool = False
    prepack: bool = True
    recompute_every: int = 50

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket.strip():
            raise FormatError(f"init_info.bucket must be a store URL, got {self.bucket!r}")
        for name in ("verify", "allow_legacy", "prepack"):
            if not isinstance(getattr(self, name), bool):
                raise FormatError(f"init_info.{name} must be true or false")
        every = self.recompute_every
        if not isinstance(every, int) or isinstance(every, bool) or not 0 <= every <= 10**6:
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
