"""Who may commit a run: one publisher at a time, each commit a compare-and-swap.

A publisher owns the run it publishes through an epoch recorded in the manifest. Starting on a
bucket that already holds its run is refused unless it takes the run over; a takeover commits the
same manifest again under the next epoch, so the previous owner's next commit - a swap expecting
the manifest it wrote last - fails (`Fenced`). The swap is strict on folders and S3 and best
effort on stores without conditional writes (Hub buckets), where readers still see a fork through
the full-state digests (`Manifest.plan(digest=)`). An owner deletes files (retention, a
takeover's leftovers, a failed attempt's uploads) only while the bucket's manifest is the one it
wrote, or a failed attempt's once a newer owner committed that version itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from deltasync.errors import Fenced, FormatError, PublishError, StoreError
from deltasync.store import Conflict, Store
from deltasync.wire.garbage import find_abandoned, find_unreferenced, remove_paths
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, read_manifest, read_manifest_bytes

__all__ = ["RunOwner"]

log = logging.getLogger(__name__)


class RunOwner:
    """One publisher's hold on a run: the epoch it writes and the manifest bytes it expects.

    Args:
        store: the bucket.
        run_id: the run this publisher writes.
        takeover: continue the bucket's run of `run_id` (else a start on it is refused).
    """

    def __init__(self, store: Store, run_id: str, *, takeover: bool):
        self.store = store
        self.run_id = run_id
        self.takeover = takeover
        self.epoch = 0
        self._expected: bytes | None = None  # the bucket's manifest as last read or written

    def claim(self, *, decide: bool = True) -> Manifest | None:
        """Read the bucket and, when `decide` (rank 0 of a sharded publisher, else always),
        refuse or take over the run. Returns the bucket's manifest of our run (to resume), None
        for a new run.

        Raises:
            PublishError: the run is in the bucket and `takeover` is off, or the takeover lost
                a race; one line.
        """
        data = read_manifest_bytes(self.store)
        manifest = None if data is None else Manifest.from_json(data)
        self._expected = data
        self.epoch = (manifest.epoch if manifest is not None else 0) + 1
        if manifest is None:
            return None
        if manifest.run_id != self.run_id:
            log.warning(
                "bucket %s holds run %s (version %d); run %s replaces it at its first commit",
                self.store.url,
                manifest.run_id,
                manifest.latest_version,
                self.run_id,
            )
            return None
        if decide:
            if not self.takeover:
                raise PublishError(self._refusal(manifest))
            self._take_over(manifest)
        return manifest

    def commit(self, manifest: Manifest, version: int) -> Manifest:
        """Swap `manifest` in for the one this owner expects; returns it as written.

        Raises:
            Fenced: the bucket's manifest changed under this owner (a takeover, another run).
        """
        manifest = manifest.committed_after(self._expected, self.epoch)
        data = manifest.to_json()
        try:
            self.store.swap(MANIFEST_PATH, data, expected=self._expected)
        except Conflict:
            raise Fenced(self._fenced_message(version), version=version) from None
        self._expected = data
        return manifest

    def remove_uncommitted(self, paths: Sequence[str], version: int) -> None:
        """Delete a failed version's uploads that the bucket's manifest does not name (a
        commit whose answer was lost names them): while that manifest is still the one this
        owner expects, or once a new owner committed this version itself. Before that, the new
        owner may be uploading the very same file (same bytes, same name): then, or when the
        manifest cannot be read, they are left to `gc`."""
        if not paths:
            return
        try:
            data = read_manifest_bytes(self.store)
            now = None if data is None else Manifest.from_json(data)
        except (StoreError, FormatError) as exc:
            log.warning("left %d files of version %d for gc: %s", len(paths), version, exc)
            return
        # a new owner committed this version with its files: ours are never named
        settled = now is not None and now.run_id == self.run_id and now.latest_version >= version
        if data != self._expected and not settled:
            return
        named = set() if now is None else now.referenced_paths()
        for path in paths:
            if path not in named:
                try:
                    self.store.delete(path)
                except StoreError as exc:
                    log.warning("could not remove %s of a failed version: %s", path, exc)

    def retire(self, paths: Sequence[str], version: int) -> None:
        """Retention after version `version` committed: delete `paths`, files its manifest no
        longer names, while the bucket's manifest is still the one this owner wrote. The
        publisher runs it after the version's future resolved, so a newer owner (a takeover,
        or on a store without conditional writes a racing publisher whose manifest may still
        name them) can hold the bucket by then: its files are then left to it and to `gc`.
        Failures are logged, never raised: the version is committed."""
        if not paths:
            return
        try:
            ours = read_manifest_bytes(self.store) == self._expected
        except (StoreError, FormatError) as exc:
            log.warning(
                "retention after version %d left %d files for gc: %s", version, len(paths), exc
            )
            return
        if not ours:
            log.warning(
                "retention after version %d left %d files for gc: another publisher holds the "
                "bucket's manifest now",
                version,
                len(paths),
            )
            return
        for path in paths:
            try:
                self.store.delete(path)
            except StoreError as exc:
                log.warning("retention could not delete %s: %s", path, exc)

    def _refusal(self, manifest: Manifest) -> str:
        age = max(0.0, time.time() - manifest.updated_at)
        return (
            f"run {manifest.run_id} is already in bucket {self.store.url} at version "
            f"{manifest.latest_version} (epoch {manifest.epoch}, last commit {age:.0f} s ago); "
            "another publisher may still be writing it: pass --takeover to continue it from "
            f"version {manifest.latest_version}, or choose another --run-id"
        )

    def _take_over(self, manifest: Manifest) -> None:
        """Commit the bucket's manifest again under our epoch (fencing any older publisher),
        then remove files of versions its publishers never committed, and uploads a killed
        writer left unfinished (`garbage.find_abandoned`).

        The files are listed before the swap: whatever is uploaded after it belongs to a newer
        owner, which may commit it before this removal runs. They are removed only while the
        manifest is still ours; else they are left for `gc`."""
        doomed = find_unreferenced(self.store, manifest, run_id=manifest.run_id, in_flight=True)
        abandoned = list(find_abandoned(self.store))
        taken = manifest.committed_after(self._expected, self.epoch)
        data = taken.to_json()
        try:
            self.store.swap(MANIFEST_PATH, data, expected=self._expected)
        except Conflict:
            raise PublishError(
                f"run {manifest.run_id} changed in bucket {self.store.url} while this publisher "
                "took it over (another publisher committed); try --takeover again"
            ) from None
        self._expected = data
        if not doomed and not abandoned:
            return
        try:
            still_ours = read_manifest_bytes(self.store) == data
        except StoreError as exc:
            log.warning("left %d files of uncommitted attempts for gc: %s", len(doomed), exc)
            return
        if still_ours:
            removed = remove_paths(self.store, doomed, abandoned)
            log.info("removed %d files of uncommitted attempts: %s", len(removed), removed[:3])

    def _fenced_message(self, version: int) -> str:
        """One line: which publisher holds the bucket now, and what to do."""
        try:
            now = read_manifest(self.store)
        except (StoreError, FormatError) as exc:
            holder = f"unreadable: {exc}"
        else:
            holder = "it is gone"
            if now is not None:
                holder = f"run {now.run_id} at version {now.latest_version}, epoch {now.epoch}"
        return (
            f"version {version} of run {self.run_id} not committed: another publisher changed "
            f"the bucket's manifest ({holder}; this publisher is epoch {self.epoch}), so this "
            "one stops; restart it with --takeover to continue from the bucket"
        )
