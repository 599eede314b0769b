"""Planning a sync: from the manifest read now, or from bytes a poll already read, with the file
a driven sync names read at the same time as the manifest.

A trainer that drives a replica names the version and its file (`UpdateInfo.path`). The replica
still plans from the manifest (the file must be the manifest's for that version; the chain and the
fork digest are checked as always), but when the named file is the delta that moves the held
version to the next one, its read starts beside the manifest's: the sync then costs one round trip
after the commit, not two. The bytes read ahead are used only when the plan is exactly that one
file, and only once they pass `manifest.check_file`, the check of every file read; otherwise they
are dropped and the plan's files are fetched as they always are. Before the manifest says how
large the file is, the read ahead is bounded by what a delta can hold for the held model
(`manifest.largest_file`) and by the size below which `Store.get_sized` reads a file in one
request (larger deltas are read after the manifest, as parallel ranges; at most that bound is
read ahead in vain).

A follower (`serve --follow`) passes the manifest bytes its poll read instead, parsed and checked
exactly as a read's would be, so nothing reads the manifest twice for one version.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from deltasync.errors import FormatError, StoreError
from deltasync.replica.replay import Fetch
from deltasync.store import Store
from deltasync.wire.manifest import (
    ChainEntry,
    FileData,
    Manifest,
    check_declared_size,
    check_file,
    largest_file,
    read_manifest_bytes,
)

__all__ = ["Planned", "ReadAhead", "plan_sync"]

log = logging.getLogger(__name__)
Shapes = Mapping[str, tuple[int, ...]]


class ReadAhead:
    """The read of the delta a driven sync names, begun before the manifest is read: at most
    `limit` bytes are accepted and at most `limit + 1` read (`Store.get(limit=)`)."""

    def __init__(self, store: Store, path: str, limit: int, shapes: Shapes):
        self.path, self.limit, self.shapes = path, limit, shapes
        self._read: Future[bytes] = Future()
        threading.Thread(
            target=self._run, args=(store,), name="deltasync-read-ahead", daemon=True
        ).start()

    @classmethod
    def start(
        cls,
        store: Store,
        held: tuple[str | None, int | None],
        target: int | None,
        path: str | None,
        shapes: Shapes,
    ) -> ReadAhead | None:
        """A read of `path` when it can be the one file a plan from `held` to `target` needs:
        the delta of the held run from the held version to the next (None otherwise: an anchor,
        a part, a replica further behind, or one that holds no model to bound the read by)."""
        run_id, version = held
        if path is None or target is None or run_id is None or version is None or not shapes:
            return None
        delta = rf"runs/{re.escape(run_id)}/deltas/{target:08d}-[0-9a-f]{{12}}\.safetensors"
        if target != version + 1 or not re.fullmatch(delta, path):
            return None
        limit = largest_file("delta", shapes)
        if store.range_workers >= 2:  # larger files are read as ranges, once their size is known
            limit = min(limit, 2 * store.range_bytes - 1)
        return cls(store, path, limit, shapes)

    def _run(self, store: Store) -> None:
        try:
            self._read.set_result(store.get(self.path, limit=self.limit))
        except BaseException as exc:  # handed to `take`, which drops it
            self._read.set_exception(exc)

    def names(self, entry: ChainEntry) -> bool:
        """Whether `entry` is the one file this read can stand for."""
        file = entry.files[0]
        return entry.parts is None and entry.kind == "delta" and file.path == self.path

    def take(self, entry: ChainEntry) -> bytes | None:
        """The bytes read, for `entry` (`names` it); None when they cannot be its (it declares
        more than was read) or the read failed: the caller then fetches the file as usual."""
        if entry.bytes > self.limit:
            return None
        try:
            return self._read.result()
        except StoreError as exc:  # missing, larger than the bound, or the bucket failed
            log.info(
                "deltasync: the read ahead of %s failed (%s); reading it again", self.path, exc
            )
            return None


@dataclass(frozen=True)
class Planned:
    """The files that lead to the target (`Manifest.plan`) and the manifest they came from."""

    manifest: Manifest
    entries: list[ChainEntry]
    ahead: ReadAhead | None = None

    def fetch(self, fetch: Fetch) -> Fetch:
        """`fetch` for the plan's files; when the plan is exactly the file read ahead, its bytes
        stand for that fetch once they pass the checks every fetched file passes (its declared
        size against the held model, then `check_file`), else they are dropped."""
        ahead, entries = self.ahead, self.entries
        if ahead is None or len(entries) != 1 or not ahead.names(entries[0]):
            return fetch
        planned = entries[0]

        def fetch_planned(store: Store, entry: ChainEntry) -> FileData:
            if entry is planned:
                (file,) = entry.files
                check_declared_size(entry, file, ahead.shapes)
                data = ahead.take(entry)
                if data is not None:
                    try:
                        return check_file(file, data, tensors=len(ahead.shapes), entry=entry)
                    except FormatError as exc:
                        log.warning(
                            "deltasync: the bytes read ahead do not match the manifest (%s); "
                            "reading the file again",
                            exc,
                        )
            return fetch(store, entry)

        return fetch_planned


def plan_sync(
    store: Store,
    held: tuple[str | None, int | None],
    target: int | None = None,
    *,
    digest: str | None,
    shapes: Shapes,
    path: str | None = None,
    manifest: bytes | None = None,
) -> Planned | None:
    """Plan the sync of a replica holding `held` (its full-state `digest` and model `shapes`)
    to `target` (None: the latest version); None when the bucket has no manifest.

    Args:
        path: the file the request names; it must be one of the manifest's files of `target`
            (a `FormatError` otherwise), and when it is the next delta it is read beside the
            manifest (`ReadAhead`).
        manifest: the manifest's bytes, already read (a follower's poll; at most
            `MAX_MANIFEST_BYTES`, as `read_manifest_bytes` reads them): nothing is read again.

    Raises:
        FormatError: the manifest is invalid or does not name `path` for `target`.
        ChainError: the bucket holds no route to `target` for this replica, or a fork.
    """
    ahead = None if manifest is not None else ReadAhead.start(store, held, target, path, shapes)
    data = read_manifest_bytes(store) if manifest is None else manifest
    if data is None:
        return None
    found = Manifest.from_json(data)
    wanted = found.latest_version if target is None else target
    if path is not None:
        entries = (e for e in (*found.anchors, *found.deltas) if e.version == wanted)
        if path not in {f.path for e in entries for f in e.files}:
            raise FormatError(f"the manifest has no file {path!r} for version {wanted}")
    return Planned(found, found.plan(*held, target, digest=digest), ahead)
