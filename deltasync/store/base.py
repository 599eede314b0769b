"""The bucket interface: a few primitives over fsspec, every path validated, every call retried."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec

from deltasync.errors import StoreError
from deltasync.store.retry import Conflict, MissingFile, RefusedObject, RetryPolicy

__all__ = ["Conflict", "MissingFile", "RefusedObject", "Store", "validate_path"]

_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_MAX_PATH = 1024


def validate_path(path: str) -> str:
    """A relative POSIX path inside the bucket: no '..', no absolute or hidden parts, no schemes.

    Raises:
        StoreError: the path could escape the bucket root or is not a plain object name.
    """
    if not isinstance(path, str) or not 0 < len(path) <= _MAX_PATH:
        raise StoreError(f"invalid bucket path {path!r}: expected 1-{_MAX_PATH} characters")
    parts = path.split("/")
    if not all(_COMPONENT.fullmatch(part) for part in parts):
        raise StoreError(
            f"invalid bucket path {path!r}: each part must be letters, digits, '.', '_' or '-' "
            "and must not start with '.' (no '..', no absolute paths, no schemes)"
        )
    return path


class Store:
    """A bucket rooted at `root` on an fsspec filesystem.

    Object stores (S3, Hub buckets, memory) replace an object in a single PUT, so `put` is atomic
    there: a reader sees the old bytes or the new ones. `LocalStore` gets the same guarantee with
    a temporary file and a rename.

    Every operation goes through `retry` (the one retry policy of the whole library): publisher,
    replica, retention deletes and metrics writes never retry on their own.

    `swap` (the manifest's commit) is a compare-and-swap: strict where `conditional_writes` is
    True (a folder: a lock file; S3: conditional puts), best effort elsewhere (Hub buckets have
    no conditional write: a racing writer is detected after the fact, not prevented).
    """

    conditional_writes = False
    range_bytes = 16 * 1024 * 1024  # `get_sized`: one ranged read per this many bytes
    range_workers = 8  # ... at most this many at once (1: one stream)

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        url: str,
        *,
        retry: RetryPolicy | None = None,
    ):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.bytes_read = 0  # object bytes this store has read (a reader's status shows them)
        self._counting = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _full(self, path: str) -> str:
        return f"{self.root}/{validate_path(path)}"

    def _call(self, what: str, path: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One operation under the retry policy, its errors as `StoreError` / `MissingFile`."""

        def once() -> Any:
            try:
                return fn(*args, **kwargs)
            except FileNotFoundError:
                raise MissingFile(f"{what}: no such file", path=path) from None
            except (RefusedObject, Conflict) as exc:
                raise type(exc)(f"{what}: {exc}", path=path) from None
            except StoreError:
                raise
            except Exception as exc:
                raise StoreError(f"{what} failed: {type(exc).__name__}: {exc}", path=path) from exc

        result = self.retry.call(once, what=f"{what} {path}")
        if what in ("get", "get_range"):
            with self._counting:
                self.bytes_read += len(result)
        return result

    def put(self, path: str, data: bytes) -> None:
        """Write a whole object (atomic for readers)."""
        self._call("put", path, self._write, self._full(path), bytes(data))

    def _write(self, full: str, data: bytes) -> None:
        """One attempt at writing a whole object (backends override this, not `put`)."""
        self.fs.pipe_file(full, data)

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        """A whole object; with `limit`, at most `limit` bytes are accepted and at most
        `limit + 1` are ever read (an object larger than it declares is refused, not held)."""
        full = self._full(path)
        if limit is None:
            return self._call("get", path, self._read, full, None)
        if limit < 0:
            raise StoreError(f"invalid read limit {limit}", path=path)
        data = self._call("get", path, self._read, full, limit + 1)
        if len(data) > limit:
            raise RefusedObject(
                f"object is larger than the {limit} bytes expected; not read", path=path
            )
        return data

    def get_sized(self, path: str, size: int) -> bytes | bytearray:
        """An object expected to hold `size` bytes (a manifest entry's file), bounded as
        `get(limit=size)` is: a larger object is refused, a shorter one comes back short.

        A bucket caps each stream's bandwidth and charges each call a round trip, so an object
        over two `range_bytes` is read as ranges, `range_workers` at a time, each retried on
        its own, straight into one buffer of `size` bytes (each range dropped once copied); the
        last range asks for one byte more than `size` to detect a larger object.
        """
        if size < 0:
            raise StoreError(f"invalid size {size}", path=path)
        if self.range_workers < 2 or size < 2 * self.range_bytes:
            return self.get(path, limit=size)
        bounds = [*range(0, size, self.range_bytes), size + 1]
        out = bytearray(size)
        filled = 0
        with ThreadPoolExecutor(self.range_workers) as pool:
            reading: deque[tuple[int, Future[bytes]]] = deque()
            for start, stop in itertools.pairwise(bounds):
                if len(reading) == self.range_workers:
                    filled = self._place(out, *reading.popleft(), filled, path)
                reading.append((start, pool.submit(self.get_range, path, start, stop)))
            while reading:
                filled = self._place(out, *reading.popleft(), filled, path)
        del out[filled:]  # a shorter object comes back short (no copy)
        return out

    def _place(
        self, out: bytearray, start: int, read: Future[bytes], filled: int, path: str
    ) -> int:
        """Copy one range of `get_sized` into place; returns the bytes filled so far."""
        data = read.result()
        if start + len(data) > len(out):
            raise RefusedObject(
                f"object is larger than the {len(out)} bytes expected; not read", path=path
            )
        if filled != start:  # an earlier range came back short: the object ends there
            return filled
        out[start : start + len(data)] = data
        return start + len(data)

    def _read(self, full: str, end: int | None) -> bytes:
        """One attempt at reading an object from its start, to `end` (None: the whole of it)."""
        if end is None:
            return self.fs.cat_file(full)
        return self.fs.cat_file(full, start=0, end=end)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, e.g. a safetensors header."""
        full = self._full(path)
        if not 0 <= start <= end:
            raise StoreError(f"invalid byte range {start}..{end}", path=path)
        if start == end:  # S3 would answer an empty range with the whole object
            self.size(path)  # still raises MissingFile for a missing object
            return b""

        def read() -> bytes:
            try:
                return self.fs.cat_file(full, start=start, end=end)
            except FileNotFoundError:
                raise
            except Exception:
                self.fs.invalidate_cache(full)
                if start >= self.fs.size(full):  # S3 answers 416 where files answer b""
                    return b""
                raise

        return self._call("get_range", path, read)

    def size(self, path: str) -> int:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return int(self._call("size", path, self.fs.size, full))

    def exists(self, path: str) -> bool:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return bool(self._call("exists", path, self.fs.exists, full))

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all objects under `prefix` (a folder, '' for the whole bucket)."""
        if not isinstance(prefix, str):
            raise StoreError(f"invalid bucket prefix {prefix!r}: expected a str")
        base = self._full(prefix.strip("/")) if prefix.strip("/") else self.root
        self.fs.invalidate_cache(base)
        try:
            found = self._call("list", prefix, self.fs.find, base)
        except MissingFile:
            return []
        strip = len(self.root) + 1
        return sorted(p[strip:] for p in found if p.startswith(self.root + "/"))

    def delete(self, path: str) -> None:
        """Remove an object; deleting a missing one is not an error."""
        full = self._full(path)
        with contextlib.suppress(MissingFile):
            self._call("delete", path, self.fs.rm_file, full)

    def abandoned_writes(self, older_than_s: float) -> dict[str, int]:
        """Temporary files of writes that never finished (a writer killed mid-upload), untouched
        for `older_than_s`, by path with their sizes. None here: an object store writes an
        object in one PUT, and a PUT that never finished leaves nothing."""
        return {}

    def delete_abandoned(self, path: str) -> None:
        """Remove one of `abandoned_writes`."""
        raise StoreError("this store leaves no temporary files", path=path)

    def publish(self, path: str, data: bytes) -> None:
        """Atomically replace a small commit-point object, unconditionally."""
        self._call("publish", path, self._write, self._full(path), bytes(data))

    def swap(self, path: str, data: bytes, *, expected: bytes | None) -> None:
        """Replace a small object only while it still holds `expected` (None: only while it does
        not exist): the manifest's commit, so two writers never both replace the same version.

        An attempt that finds `data` already in place succeeded (a retry after a lost answer).

        Raises:
            Conflict: the object holds something else: another writer got there first.
        """
        self._call("swap", path, self._swap, self._full(path), bytes(data), expected)

    def _swap(self, full: str, data: bytes, expected: bytes | None) -> None:
        """One attempt: compare, write, and where the write is not conditional, read back."""
        current = self._current(full, max(len(data), len(expected or b"")))
        if current == data:
            return
        if current != expected:
            raise Conflict("the object changed since it was read (another writer)")
        self._write(full, data)
        if not self.conditional_writes and self._current(full, len(data)) != data:
            raise Conflict("another writer replaced the object right after this write")

    def _current(self, full: str, limit: int) -> bytes | None:
        """An object's bytes (None when missing), at most `limit + 1` of them: a larger object
        equals neither side of a swap."""
        try:
            return self._read(full, limit + 1)
        except FileNotFoundError:
            return None
