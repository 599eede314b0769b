"""A folder as the bucket: the default for `launch.py --local` and the tests."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import time
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from deltasync.errors import StoreError
from deltasync.store.base import RefusedObject, Store, validate_path
from deltasync.store.retry import RetryPolicy

__all__ = ["LocalStore", "current_umask"]

_TEMPORARY = ".tmp-"  # a write in progress: `LocalStore._write`'s temporary file


def current_umask() -> int:
    """This process's umask, read without changing it (Linux); elsewhere set and set back,
    which other threads could see for an instant."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class LocalStore(Store):
    """Writes go to a temporary file that is fsynced and renamed, so readers never see a partial
    file and a crash leaves the previous version in place.

    Reads open only regular files inside the folder: a symlink anywhere below the root, a FIFO
    or a device is refused before a byte is read (a planted `manifest.json -> /dev/zero` or a
    FIFO would otherwise exhaust memory or block the reader), and the error names no target.

    `swap` is strict between processes on one machine: it compares and replaces under an
    exclusive `flock` on a hidden lock file beside the object.
    """

    conditional_writes = True
    lock_wait_s = 30.0  # a holder keeps the lock for one small read and write

    def __init__(self, folder: str | os.PathLike[str], *, retry: RetryPolicy | None = None):
        path = Path(folder).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        super().__init__(LocalFileSystem(), str(path), str(path), retry=retry)

    def _write(self, full: str, data: bytes) -> None:
        target = Path(full)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TEMPORARY, dir=target.parent)
        try:
            # as readable as any file the user writes: a replica or dashboard running as another
            # user (a container's uid 1000) reads the bucket folder too
            os.fchmod(fd, 0o666 & ~current_umask())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _swap(self, full: str, data: bytes, expected: bytes | None) -> None:
        target = Path(full)
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(
            target.parent / f".lock-{target.name}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644
        )
        try:
            deadline = time.monotonic() + self.lock_wait_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreError(
                            f"lock on {target.name} held for {self.lock_wait_s} s"
                        ) from None
                    time.sleep(0.005)
            super()._swap(full, data, expected)
        finally:
            os.close(lock)  # releases the lock

    def _open_regular(self, full: str) -> int:
        """A read-only descriptor of a regular file under the root (no symlink on the way)."""
        symlink = RefusedObject("not a regular file inside the bucket (a symlink); refused")
        if os.path.realpath(full) != os.path.normpath(full):
            raise symlink
        try:  # O_NOFOLLOW: a symlink planted after the check; O_NONBLOCK: a FIFO does not block
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise symlink from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RefusedObject(
                "not a regular file inside the bucket (a FIFO, device or folder); refused"
            )
        return fd

    def _read(self, full: str, end: int | None) -> bytes:
        with os.fdopen(self._open_regular(full), "rb") as f:
            return f.read() if end is None else f.read(end)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        full = self._full(path)
        if not 0 <= start <= end:
            raise StoreError(f"invalid byte range {start}..{end}", path=path)

        def read() -> bytes:
            with os.fdopen(self._open_regular(full), "rb") as f:
                f.seek(start)
                return f.read(end - start)

        return self._call("get_range", path, read)

    def size(self, path: str) -> int:
        full = self._full(path)

        def measure() -> int:
            with os.fdopen(self._open_regular(full), "rb") as f:
                return os.fstat(f.fileno()).st_size

        return int(self._call("size", path, measure))

    def list(self, prefix: str = "") -> list[str]:
        """Objects only: temporary files of writes in progress and lock files are hidden."""
        return [p for p in super().list(prefix) if not Path(p).name.startswith(".")]

    def abandoned_writes(self, older_than_s: float) -> dict[str, int]:
        """Temporary files of `_write` (never symlinks) not modified for `older_than_s`: a write
        in progress touches its file as it goes, one killed before its rename does not."""
        cutoff = time.time() - older_than_s
        found = {}
        for folder, _, names in os.walk(self.root):  # does not follow symlinked folders
            for name in names:
                if not name.startswith(_TEMPORARY):
                    continue
                full = os.path.join(folder, name)
                try:
                    info = os.lstat(full)
                except FileNotFoundError:  # renamed into place (or removed) since it was listed
                    continue
                if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                    found[os.path.relpath(full, self.root)] = info.st_size
        return dict(sorted(found.items()))

    def delete_abandoned(self, path: str) -> None:
        folder, _, name = path.rpartition("/")
        if not name.startswith(_TEMPORARY) or "/" in name or not validate_path(name[1:]):
            raise StoreError("not a temporary file of a write", path=path)
        parent = Path(self._full(folder)) if folder else Path(self.root)
        if os.path.realpath(parent) != os.path.normpath(parent):
            raise StoreError("not inside the bucket (a symlink on the way)", path=path)
        (parent / name).unlink(missing_ok=True)
