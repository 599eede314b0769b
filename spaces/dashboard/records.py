"""Typed views of what the dashboard reads: metrics records and safetensors headers.

Metrics records are `deltasync.metrics.SyncRecord` (exact keys, parsed by its `from_json`);
headers become `HeaderInfo` here. The rest of the dashboard never sees raw dicts (STYLE 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltasync.codec import read_metadata
from deltasync.errors import FormatError
from deltasync.manifest import ChainEntry
from deltasync.metrics import SyncRecord
from deltasync.store import Store

__all__ = ["HeaderInfo", "SyncRecord", "read_header"]


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
