"""A folder as the bucket: the default for `launch.py --local` and the tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from .base import Store
from .retry import RetryPolicy

__all__ = ["LocalStore"]


class LocalStore(Store):
    """Writes go to a temporary file that is fsynced and renamed, so readers never see a partial
    file and a crash leaves the previous version in place."""

    def __init__(self, folder: str | os.PathLike[str], *, retry: RetryPolicy | None = None):
        path = Path(folder).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        super().__init__(LocalFileSystem(), str(path), str(path), retry=retry)

    def _write(self, full: str, data: bytes) -> None:
        target = Path(full)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def list(self, prefix: str = "") -> list[str]:
        return [p for p in super().list(prefix) if not Path(p).name.startswith(".tmp-")]
