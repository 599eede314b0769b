"""A stored file read in bounded memory: its header by byte range, then its bytes in pieces.

An anchor is as large as the model, so no reader holds one whole: `StoredFile.open` reads the
file's first `HEAD_BYTES` (one request: a small file is read whole, as before) and checks the
header (bounded by the reader's model, before any data byte is used); `pieces` reads byte ranges
of at most `Store.range_bytes`, in order, with at most `window` bytes in flight,
`Store.range_workers` at a time. Whoever consumes the pieces puts them where they belong (a
tensor, a worker's box, a digest) and drops them. `stream` reads the whole file and checks its
size and whole-file digest once the last piece has passed; its last request asks for one byte
past the declared size, so a larger object is refused without another round trip.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from deltasync.defaults import READ_WINDOW_BYTES
from deltasync.errors import FormatError
from deltasync.store import Store
from deltasync.wire.header import SafetensorsHeader, parse_header
from deltasync.wire.metadata import FileMetadata

__all__ = ["ByteRange", "StoredFile"]

MERGE_GAP = 1 << 20  # ranges of whole bytes this close are read as one request
MMAP_FROM = 16 << 20  # blocks this large come from (and go back to) the kernel at once
HEAD_BYTES = 1 << 20  # read with the header: a typical header, or a small file whole


@functools.cache
def _large_blocks_mapped() -> None:
    """Keep the pieces of a read out of glibc's arenas (once per process). glibc raises its
    mmap threshold to the largest block freed (up to 32 MiB), so after the first piece every
    piece comes from a thread's arena, which keeps much of what is freed: a reader measured
    100-200 MiB past its window, varying from run to run. A fixed threshold maps pieces of
    `MMAP_FROM` bytes or more and unmaps them as soon as they are dropped; smaller blocks are
    as before. Elsewhere than glibc, nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-3, MMAP_FROM)  # M_MMAP_THRESHOLD


@dataclass(frozen=True)
class ByteRange:
    """Bytes `[start, stop)` of a file; every piece read of it starts on a multiple of `align`
    bytes from `start` (a tensor's rows, where the reader takes columns of each)."""

    start: int
    stop: int
    align: int = 1


def _merged(ranges: Sequence[ByteRange]) -> list[ByteRange]:
    """`ranges` ascending, empty ones dropped, unaligned ones closer than `MERGE_GAP` joined."""
    out: list[ByteRange] = []
    for r in sorted((r for r in ranges if r.stop > r.start), key=lambda r: r.start):
        last = out[-1] if out else None
        if last and last.align == r.align == 1 and r.start - last.stop <= MERGE_GAP:
            out[-1] = ByteRange(last.start, max(last.stop, r.stop))
        else:
            out.append(r)
    return out


@dataclass(frozen=True)
class StoredFile:
    """A file of the bucket whose header passed every check: `size` and `digest` are what the
    manifest says of it; nothing of its data has been read."""

    store: Store
    path: str
    size: int
    digest: str
    header: SafetensorsHeader
    meta: FileMetadata
    head: bytes  # the file's first bytes, read with the header

    @classmethod
    def open(
        cls, store: Store, path: str, size: int, digest: str, *, tensors: int | None = None
    ) -> StoredFile:
        """Read and check the header (bounded by `tensors`, the reader's tensor count, when
        known; its offsets must tile the `size` bytes the manifest declares); raises
        `FormatError` for anything that is not a valid header of ours."""

        head = store.get_range(path, 0, min(size + 1, HEAD_BYTES))
        if len(head) > size:
            raise FormatError(
                f"file does not match the manifest: larger than the {size} bytes it says",
                path=path,
            )

        def read(start: int, end: int) -> bytes:
            return head[start:end] if end <= len(head) else store.get_range(path, start, end)

        header = parse_header(read, size, path=path, tensors=tensors)
        meta = FileMetadata.from_header(header, path=path)
        return cls(store, path, size, digest, header, meta, head)

    def pieces(
        self, ranges: Sequence[ByteRange], *, window: int = READ_WINDOW_BYTES
    ) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of `ranges`, in ascending order, each piece read whole (a short read
        is a truncated file: `FormatError`); bytes of the head are not read again."""
        _large_blocks_mapped()
        return self._pieces(ranges, window, probe_end=False)

    def _pieces(
        self, ranges: Sequence[ByteRange], window: int, *, probe_end: bool
    ) -> Iterator[tuple[int, bytes]]:
        """`pieces`; with `probe_end`, the last request asks for one byte past the file's
        declared size, which must not be there."""
        step, head = self.store.range_bytes, len(self.head)
        todo = []
        for r in _merged(ranges):
            size = max(r.align, step // r.align * r.align)
            for start in range(r.start, r.stop, size):
                todo.append((start, min(r.stop, start + size)))
        # the piece being consumed counts: at most `window` bytes of pieces are alive at once
        in_flight = max(1, min(self.store.range_workers, window // step - 1))
        last = len(todo) - 1
        with ThreadPoolExecutor(in_flight, thread_name_prefix="deltasync-read") as pool:
            reading: deque[tuple[int, int, Future[bytes] | bytes]] = deque()
            try:
                for i, (start, stop) in enumerate(todo):
                    if len(reading) == in_flight:
                        yield self._take(*reading.popleft())
                    if stop <= head:
                        reading.append((start, stop, self.head[start:stop]))
                        continue
                    end = stop + 1 if probe_end and i == last else stop
                    future = pool.submit(self.store.get_range, self.path, start, end)
                    reading.append((start, stop, future))
                while reading:
                    yield self._take(*reading.popleft())
            finally:  # a consumer that stops early: nothing more is read
                for *_, future in reading:
                    if isinstance(future, Future):
                        future.cancel()

    def _take(self, start: int, stop: int, read: Future[bytes] | bytes) -> tuple[int, bytes]:
        data = read if isinstance(read, bytes) else read.result()
        if len(data) > stop - start:
            raise FormatError(
                f"file does not match the manifest: larger than the {self.size} bytes it says",
                path=self.path,
            )
        if len(data) != stop - start:
            raise FormatError(
                f"short read at byte {start}: the file is truncated (the manifest says "
                f"{self.size} bytes)",
                path=self.path,
            )
        return start, data

    def stream(self, *, window: int = READ_WINDOW_BYTES) -> Iterator[tuple[int, bytes]]:
        """Every byte of the file as pieces, in order; after the last one, its size and
        whole-file xxh3-128 are checked against the manifest's (`FormatError`)."""
        _large_blocks_mapped()
        hasher = xxhash.xxh3_128()
        if self.head:
            hasher.update(self.head)
            yield 0, self.head
        rest = [ByteRange(len(self.head), self.size)]
        for start, data in self._pieces(rest, window, probe_end=True):
            hasher.update(data)
            yield start, data
        if hasher.hexdigest() != self.digest:
            raise FormatError(
                "file does not match the manifest (its digest differs: the bytes changed "
                "after it was published)",
                path=self.path,
            )
