"""Typed views of what the dashboard reads: metrics records and safetensors headers.

Metrics records are `deltasync.wire.metrics.SyncRecord` (exact keys, parsed by its `from_json`);
headers become `HeaderInfo` here. The rest of the dashboard never sees raw dicts (STYLE 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltasync.codec import FileMetadata, read_metadata
from deltasync.errors import FormatError
from deltasync.store import Store
from deltasync.wire.manifest import ChainEntry, PartRef
from deltasync.wire.metrics import SyncRecord

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
    """The header of a manifest entry: per file, `size`, then bytes [0, 8) and [8, 8 + n) only.
    A sharded version's parts are read each and added up.

    Raises:
        MissingFile: the manifest names a file the bucket does not list (yet).
        FormatError: the file is corrupt or disagrees with the manifest.
        StoreError: the bucket could not be read.
    """
    total = changed = header_bytes = 0
    meta = None
    for file in entry.files:
        meta, data_offset = _read_one(store, file, entry, run_id)
        total += meta.total_elements
        changed += meta.changed_elements
        header_bytes += data_offset
    assert meta is not None  # an entry names at least one file
    if meta.kind == "anchor":  # an anchor holds every element; its sparsity is meaningless
        changed = total
    return HeaderInfo(
        version=meta.version,
        kind=meta.kind,
        encoding=meta.encoding,
        total_elements=total,
        changed_elements=changed,
        sparsity=(1.0 - changed / total if total else 1.0) if meta.kind == "delta" else 0.0,
        header_bytes=header_bytes,
    )


def _read_one(
    store: Store, file: PartRef, entry: ChainEntry, run_id: str
) -> tuple[FileMetadata, int]:
    size = store.size(file.path)
    if size != file.bytes:
        raise FormatError(f"file is {size} bytes, the manifest says {file.bytes}", path=file.path)
    meta, header = read_metadata(
        lambda start, end: store.get_range(file.path, start, end), size, path=file.path
    )
    found = (meta.version, meta.kind, meta.run_id)
    if found != (entry.version, entry.kind, run_id):
        raise FormatError(
            f"header says version {meta.version} {meta.kind} of run {meta.run_id!r}, "
            f"the manifest says version {entry.version} {entry.kind} of run {run_id!r}",
            path=file.path,
        )
    return meta, header.data_offset
