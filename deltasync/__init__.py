"""deltasync: bf16 weight deltas for async RL, published through an object-storage bucket.

Importing the package loads no torch: the bucket side (errors, stores, manifest, file headers)
is torch-free, and the tensor side (`Publisher`, `Replica`, `Bf16Snapshot`, ...) loads on first
use, so the dashboard and `python -m deltasync inspect` run without torch installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ChainError,
    DeltaSyncError,
    DigestMismatch,
    FormatError,
    PublishError,
    StoreError,
)
from .manifest import Manifest, read_manifest
from .metrics import SyncRecord
from .policy import AnchorPolicy
from .store import RetryPolicy, Store, open_store

if TYPE_CHECKING:
    from .changes import Diff, TensorChange
    from .publisher import Publisher, PublisherConfig
    from .replica import DictSink, Replica, Sink
    from .snapshot import Bf16Snapshot

__all__ = [
    "AnchorPolicy",
    "Bf16Snapshot",
    "ChainError",
    "DeltaSyncError",
    "DictSink",
    "Diff",
    "DigestMismatch",
    "FormatError",
    "Manifest",
    "MissingExtra",
    "PublishError",
    "Publisher",
    "PublisherConfig",
    "Replica",
    "RetryPolicy",
    "Sink",
    "Store",
    "StoreError",
    "SyncRecord",
    "TensorChange",
    "open_store",
    "read_manifest",
]

_TENSOR_SIDE = {
    "Bf16Snapshot": "snapshot",
    "DictSink": "replica",
    "Diff": "changes",
    "Publisher": "publisher",
    "PublisherConfig": "publisher",
    "Replica": "replica",
    "Sink": "replica",
    "TensorChange": "changes",
}


def __getattr__(name: str) -> Any:
    if name in _TENSOR_SIDE:
        return getattr(import_tensor_side(f"{__name__}.{_TENSOR_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class MissingExtra(ImportError):
    """The tensor side was asked for where only the torch-free core is installed."""


def import_tensor_side(module: str) -> Any:
    """Import a module of the tensor side, naming the extra to install when torch & co. lack."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in {"torch", "numpy", "numba", "safetensors", "zstandard"}:
            raise MissingExtra(
                f"{module} needs {missing}: pip install 'deltasync[torch]' ({exc})",
                name=exc.name,
            ) from exc
        raise
