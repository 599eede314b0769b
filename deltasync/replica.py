"""The reader side, framework-free: bootstrap, stage (no mutation) and apply (verified, atomic)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .codec import DecodedFile, decode
from .codec.header import parse_header_bytes
from .codec.metadata import FileMetadata
from .digest import bytes_digest, tensor_digest
from .errors import ChainError, DigestMismatch, FormatError
from .manifest import MANIFEST_PATH, MAX_MANIFEST_BYTES, ChainEntry, Manifest
from .retry import with_retries
from .snapshot import TensorChange, scatter
from .store import MissingFile, Store

__all__ = ["Replica", "StagedUpdate", "read_manifest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedUpdate:
    """A decoded, validated file ready to apply; `noop` for a version the replica already holds."""

    meta: FileMetadata
    path: str | None
    decoded: DecodedFile | None = None
    noop: bool = False
    stats: dict[str, float] = field(default_factory=dict)


def read_manifest(store: Store, *, attempts: int = 4, backoff_s: float = 0.5) -> Manifest | None:
    """The bucket's manifest, or None for an empty bucket.

    Its size is checked before it is downloaded, so an oversized object is never held in memory.
    """
    try:
        size = with_retries(
            lambda: store.size(MANIFEST_PATH),
            what="read manifest size",
            attempts=attempts,
            backoff_s=backoff_s,
        )
    except MissingFile:
        return None
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(
            f"manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES}; not downloaded",
            path=MANIFEST_PATH,
        )
    data = with_retries(
        lambda: store.get(MANIFEST_PATH),
        what="read manifest",
        attempts=attempts,
        backoff_s=backoff_s,
    )
    return Manifest.from_json(data)


class Replica:
    """A bf16 copy of the served weights at a known (run, version).

    Invariants: a delta applies only on its exact base version of the same run; anything
    malformed raises before the state is touched; a digest mismatch after applying rolls the
    update back. Serving code (the vLLM extension) loads from `tensors` after `apply` succeeds.

    Args:
        allow_legacy: accept TRL v1 files, which carry no run, base version or digests (their
            base is assumed to be the version held, and nothing can be verified).
    """

    def __init__(self, *, allow_legacy: bool = False):
        self.tensors: dict[str, torch.Tensor] = {}
        self.run_id: str | None = None
        self.version: int | None = None
        self.allow_legacy = allow_legacy

    def stage(self, data: bytes, *, path: str | None = None) -> StagedUpdate:
        """Decode and validate `data` against the current state without changing it."""
        meta = FileMetadata.from_strings(parse_header_bytes(data, path=path).metadata, path=path)
        if meta.legacy and not self.allow_legacy:
            raise FormatError(
                "TRL v1 file without run id or digests; construct the Replica with "
                "allow_legacy=True to apply it unverified",
                path=path,
            )
        if not meta.legacy and meta.run_id == self.run_id and meta.version == self.version:
            return StagedUpdate(meta, path, noop=True)
        if meta.kind == "delta":
            self._check_chain(meta, path)
            if not meta.legacy:
                self._check_model(meta, path)
        elif not meta.legacy and meta.run_id == self.run_id and meta.version < (self.version or 0):
            raise ChainError(  # a late notification: going back would serve stale weights
                f"anchor {meta.version} of run {meta.run_id!r} is older than version "
                f"{self.version}, which the replica holds{f' ({path})' if path else ''}",
                expected=self.version,
                found=meta.version,
            )
        decoded = decode(data, base=self.tensors, path=path)
        if meta.kind == "anchor":
            self._check_anchor(decoded, path)
        return StagedUpdate(meta, path, decoded)

    def apply(self, staged: StagedUpdate) -> bool:
        """Make the staged version current; returns False for a duplicate (no-op).

        Raises:
            ChainError: the state moved since staging.
            DigestMismatch: the result does not match the file's digests (state rolled back).
        """
        if staged.noop:
            return False
        assert staged.decoded is not None
        meta = staged.meta
        if meta.kind == "anchor":
            self.tensors = dict(staged.decoded.tensors)
        else:
            self._check_chain(meta, staged.path)
            self._apply_changes(staged.decoded.changes, meta, staged.path)
        if not meta.legacy:
            self.run_id = meta.run_id
        self.version = meta.version
        return True

    def update(self, data: bytes, *, path: str | None = None) -> bool:
        return self.apply(self.stage(data, path=path))

    def sync(self, store: Store, *, attempts: int = 4, backoff_s: float = 0.5) -> list[int]:
        """Catch up with the bucket (bootstrap when empty); returns the versions applied."""
        manifest = read_manifest(store, attempts=attempts, backoff_s=backoff_s)
        if manifest is None:
            return []
        applied = []
        for entry in manifest.catch_up_plan(self.run_id, self.version):
            data = fetch_entry(store, entry, attempts=attempts, backoff_s=backoff_s)
            if self.update(data, path=entry.path):
                applied.append(entry.version)
        return applied

    def digests(self) -> dict[str, str]:
        return {name: tensor_digest(t) for name, t in self.tensors.items()}

    def verify(self, meta: FileMetadata) -> None:
        """Check every tensor against a file's digests (e.g. the latest anchor's)."""
        for name, entry in meta.tensors.items():
            found = tensor_digest(self.tensors[name])
            if found != entry.digest:
                raise DigestMismatch(name, entry.digest or "", found)

    def _check_chain(self, meta: FileMetadata, path: str | None) -> None:
        if self.version is None:
            raise ChainError(
                f"cannot apply delta {meta.version} to an empty replica; load an anchor first",
                expected="anchor",
                found="delta",
            )
        if meta.legacy:
            return
        if meta.run_id != self.run_id:
            raise ChainError(
                f"delta of run {meta.run_id!r} refused: replica holds run {self.run_id!r}",
                expected=self.run_id,
                found=meta.run_id,
            )
        if meta.base_version != self.version:
            raise ChainError(
                f"delta {meta.version} has base {meta.base_version} but replica is at "
                f"{self.version}{f' ({path})' if path else ''}",
                expected=self.version,
                found=meta.base_version,
            )

    def _check_model(self, meta: FileMetadata, path: str | None) -> None:
        """A delta lists every tensor of its model: the names and shapes the replica holds."""
        ours = {n: tuple(t.shape) for n, t in self.tensors.items()}
        theirs = {n: e.shape for n, e in meta.tensors.items()}
        if ours != theirs:
            diff = sorted(set(ours.items()) ^ set(theirs.items()))[:5]
            raise FormatError(f"delta is for another model: tensors differ {diff}", path=path)

    def _check_anchor(self, decoded: DecodedFile, path: str | None) -> None:
        if self.tensors:
            ours = {n: tuple(t.shape) for n, t in self.tensors.items()}
            theirs = {n: tuple(t.shape) for n, t in decoded.tensors.items()}
            if ours != theirs:
                diff = sorted(set(ours.items()) ^ set(theirs.items()))[:5]
                raise FormatError(f"anchor is for another model: tensors differ {diff}", path=path)
        for name, entry in decoded.meta.tensors.items():
            found = tensor_digest(decoded.tensors[name])
            if found != entry.digest:
                raise DigestMismatch(name, entry.digest or "", found, path=path)

    def _apply_changes(
        self, changes: dict[str, TensorChange], meta: FileMetadata, path: str | None
    ) -> None:
        done: list[tuple[torch.Tensor, TensorChange]] = []
        try:
            for name, change in changes.items():
                scatter(self.tensors[name], change.indices, change.values)
                done.append((self.tensors[name], change))
            for name in () if meta.legacy else changes:  # legacy files carry no digests
                expected = meta.tensors[name].digest
                found = tensor_digest(self.tensors[name])
                if found != expected:
                    raise DigestMismatch(name, expected or "", found, path=path)
        except BaseException:
            for tensor, change in reversed(done):
                scatter(tensor, change.indices, change.previous)
            raise


def fetch_entry(
    store: Store, entry: ChainEntry, *, attempts: int = 4, backoff_s: float = 0.5
) -> bytes:
    """Download a manifest entry and check its size and whole-file digest before parsing."""
    data = with_retries(
        lambda: store.get(entry.path),
        what=f"download {entry.path}",
        attempts=attempts,
        backoff_s=backoff_s,
    )
    if len(data) != entry.bytes or bytes_digest(data) != entry.digest:
        raise FormatError(
            f"file does not match the manifest ({len(data)} bytes, expected "
            f"{entry.bytes}, or digest differs)",
            path=entry.path,
        )
    return data
