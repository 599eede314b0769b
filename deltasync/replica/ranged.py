"""Reading only the boxes a tensor-parallel worker holds from an anchor: header, then byte ranges.

An anchor is every tensor whole; a worker holding one box of each (`deltasync.kernels.boxes`) needs
about 1/TP of it. Each file is read as its header (two ranged reads), then, per tensor, the rows
that hold the worker's box (a range of rows; for a range of columns, the tensor's rows, as a
row-major file stores them), with nearby ranges merged into one request. The bytes land at their
offsets in an anonymous memory map of the file's size, whose pages never written take no memory,
so `codec.decode(..., boxes=...)` reads them as from the whole file. The whole-file xxh3 digest
cannot be checked on a part of a file: the header must still promise the manifest's full-state
digest, and the workers' combined digest of the values read checks every element.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.store import Store
from deltasync.wire.header import parse_header
from deltasync.wire.manifest import (
    ChainEntry,
    FileData,
    PartRef,
    check_declared_size,
    fetch_entry,
)
from deltasync.wire.metadata import FileMetadata

__all__ = ["fetch_boxes"]

MERGE_GAP = 1 << 20  # ranges this close are read as one request
BoxesOf = Callable[[dict[str, tuple[int, ...]]], Mapping[str, Box]]


def fetch_boxes(
    store: Store,
    entry: ChainEntry,
    boxes_of: BoxesOf,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> FileData:
    """`manifest.fetch_entry` for a reader holding the boxes `boxes_of(shapes)`: an anchor's
    files by byte range (see the module docstring), a delta's whole (deltas are small).
    `shapes` (the reader's whole model, when known) bounds each declared size and header."""
    if entry.kind != "anchor":
        return fetch_entry(store, entry, shapes=shapes)
    for file in entry.files:
        check_declared_size(entry, file, shapes)
    tensors = len(shapes) if shapes else None
    found = tuple(_fetch_file(store, file, boxes_of, tensors) for file in entry.files)
    return found[0] if entry.parts is None else found


def _fetch_file(store: Store, file: PartRef, boxes_of: BoxesOf, tensors: int | None) -> mmap.mmap:
    def read(start: int, end: int) -> bytes:
        return store.get_range(file.path, start, end)

    header = parse_header(read, file.bytes, path=file.path, tensors=tensors)
    meta = FileMetadata.from_header(header, path=file.path)
    found = meta.state_digest
    if (found and found.hex()) != file.state_digest:
        raise FormatError(
            f"file's state digest {found} differs from the manifest's {file.state_digest}",
            path=file.path,
        )
    boxes = boxes_of({n: e.shape for n, e in meta.tensors.items()})
    if meta.part is not None:
        boxes = {n: b.clip(*meta.part.rows[n]) for n, b in boxes.items()}
    ranges = []
    for name, info in header.tensors.items():
        box = boxes.get(name)
        if box is None:
            raise FormatError("unknown tensor name (not in the reader's model)", path=file.path)
        row_bytes = 2 * box.row_numel
        r0, r1 = box.rows if box.cols is None else (0, info.shape[0] if info.shape else 1)
        start = header.data_offset + info.start + r0 * row_bytes
        ranges.append((start, min(start + (r1 - r0) * row_bytes, header.data_offset + info.end)))
    out = mmap.mmap(-1, max(file.bytes, 1))
    head = read(0, header.data_offset)
    if len(head) != header.data_offset:
        raise FormatError("short read of the header: the file is truncated", path=file.path)
    out[: header.data_offset] = head
    for start, stop in _merged(ranges):
        data = read(start, stop)
        if len(data) != stop - start:
            raise FormatError(f"short read at byte {start}: the file is truncated", path=file.path)
        out[start:stop] = data
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start - out[-1][1] <= MERGE_GAP:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out
