"""Garbage: chain files no manifest names (failed, fenced or killed attempts, replaced runs), and
temporary files of uploads a killed writer never finished (a folder bucket's).

Only anchors, deltas and their parts, and a store's own temporary files untouched for
`ABANDONED_AFTER_S`, are ever candidates; metrics records, leases, replica records and anything
else in the bucket are never touched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from deltasync.store import Store
from deltasync.wire.manifest import Manifest

__all__ = ["ABANDONED_AFTER_S", "find_abandoned", "find_unreferenced", "remove_paths"]

ABANDONED_AFTER_S = 3600.0  # a temporary file untouched this long belongs to no live upload

log = logging.getLogger(__name__)

_CHAIN_FILE = re.compile(
    r"runs/(?P<run>[^/]+)/(?:anchors|deltas)/(?P<version>\d{8})-(?:part\d+of\d+-)?[0-9a-f]{12}"
    r"\.safetensors"
)


def find_unreferenced(
    store: Store, manifest: Manifest | None, *, run_id: str | None = None, in_flight: bool = False
) -> list[str]:
    """Chain files under `runs/` (only `runs/<run_id>/` when given) that `manifest` does not name.

    Files of the manifest's own run at versions after its latest may be uploads a live publisher
    is about to commit: they count only with `in_flight` (the caller fenced that publisher).
    """
    named = set() if manifest is None else manifest.referenced_paths()
    found = []
    for path in store.list(f"runs/{run_id}" if run_id else "runs"):
        match = _CHAIN_FILE.fullmatch(path)
        if match is None or path in named:
            continue
        live = manifest is not None and match["run"] == manifest.run_id
        if live and int(match["version"]) > manifest.latest_version and not in_flight:
            continue
        found.append(path)
    return found


def find_abandoned(store: Store, older_than_s: float = ABANDONED_AFTER_S) -> dict[str, int]:
    """Temporary files of uploads never finished, untouched for `older_than_s`, with sizes."""
    return store.abandoned_writes(older_than_s)


def remove_paths(store: Store, paths: list[str], abandoned: Sequence[str] = ()) -> list[str]:
    """Delete `paths` and the `abandoned` temporary files, best effort (what fails is left for
    `gc`); returns what was deleted."""
    removed = []
    deletions = [(p, store.delete) for p in paths]
    deletions += [(p, store.delete_abandoned) for p in abandoned]
    for path, delete in deletions:
        try:
            delete(path)
        except Exception as exc:  # best effort: `gc` finds it again
            log.warning("could not remove %s: %s", path, exc)
        else:
            removed.append(path)
    return removed
