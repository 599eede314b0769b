"""S3 (and S3-compatible) buckets: conditional puts make the manifest's commit strict."""

from __future__ import annotations

from deltasync.store.base import Store
from deltasync.store.retry import Conflict

__all__ = ["S3Store"]

_PRECONDITION = ("PreconditionFailed", "ConditionalRequestConflict")


class S3Store(Store):
    """`swap` reads the object's ETag, compares its bytes, then puts with `If-Match` on that
    ETag (`If-None-Match: *` for a first write), so S3 itself refuses a write that lost a race.
    """

    conditional_writes = True

    def _swap(self, full: str, data: bytes, expected: bytes | None) -> None:
        self.fs.invalidate_cache(full)
        try:  # the ETag first: a change after it makes the conditional put fail, never succeed
            etag = self.fs.info(full)["ETag"]
        except FileNotFoundError:
            etag = None
        limit = max(len(data), len(expected or b""))
        current = None if etag is None else self._current(full, limit)
        if current == data:
            return
        if current != expected:
            raise Conflict("the object changed since it was read (another writer)")
        try:
            if etag is None:
                self.fs.pipe_file(full, data, mode="create")
            else:
                self.fs.pipe_file(full, data, IfMatch=etag)
        except OSError as exc:
            if isinstance(exc, FileExistsError) or _precondition_failed(exc):
                raise Conflict(
                    "another writer replaced the object first (conditional put)"
                ) from None
            raise
        finally:
            self.fs.invalidate_cache(full)


def _precondition_failed(exc: BaseException) -> bool:
    """s3fs wraps a 412 in an OSError whose cause is botocore's ClientError."""
    response = getattr(exc.__cause__, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in _PRECONDITION
