"""Layer 1, bucket stores: `open_store(url)` picks a folder, a Hub bucket or any fsspec URL.

One small interface (`base.Store`), one module per backend; path checks, bounded reads and
retries live here. May import `deltasync.errors` only; torch-free.
"""

from __future__ import annotations

import re
from typing import Any

import fsspec

from deltasync.errors import StoreError
from deltasync.store.base import Conflict, MissingFile, RefusedObject, Store, validate_path
from deltasync.store.local import LocalStore
from deltasync.store.retry import RetryPolicy
from deltasync.store.s3 import S3Store

__all__ = [
    "Conflict",
    "LocalStore",
    "MissingFile",
    "RefusedObject",
    "RetryPolicy",
    "S3Store",
    "Store",
    "open_store",
    "validate_path",
]

_HF_BUCKET = re.compile(r"hf://buckets/[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(/[\w./-]*)?")
_EXTRAS = {"s3": "s3fs (pip install 'deltasync[s3]')", "gs": "gcsfs", "gcs": "gcsfs"}


def open_store(url: str, *, retry: RetryPolicy | None = None, **storage_options: Any) -> Store:
    """Open a bucket by URL; every operation on it is retried by `retry` (default 4 attempts).

    - a path or `file://...`: a local folder (created if missing);
    - `hf://buckets/NAMESPACE/NAME[/prefix]`: a Hugging Face bucket (never a model/dataset repo);
    - any other fsspec URL (`memory://`, `s3://`, `gs://`, ...), with `storage_options` passed on.
    """
    if "://" not in url:
        return LocalStore(url, retry=retry)
    protocol = url.split("://", 1)[0]
    if protocol == "file":
        return LocalStore(url.split("://", 1)[1], retry=retry)
    if protocol == "hf" and not _HF_BUCKET.fullmatch(url.rstrip("/")):
        raise StoreError(f"{url!r} is not a bucket URL: expected hf://buckets/NAMESPACE/NAME")
    if ".." in url.split("://", 1)[1].split("/"):
        raise StoreError(f"{url!r} contains '..'")
    try:
        fs, root = fsspec.url_to_fs(url, **storage_options)
    except ImportError as exc:
        need = _EXTRAS.get(protocol, "the fsspec backend for it")
        raise StoreError(f"the {protocol}:// store needs {need}: {exc}") from None
    except ValueError as exc:
        raise StoreError(
            f"cannot open {url!r}: {exc}; use a folder, hf://buckets/NS/NAME, s3://, gs://, "
            "memory:// or another fsspec protocol"
        ) from None
    backend = S3Store if protocol in ("s3", "s3a") else Store
    return backend(fs, root, url, retry=retry)
