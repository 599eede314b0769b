"""deltasync: bf16 weight deltas for async RL, published through an object-storage bucket.

A facade: it names the public types and no module of the package imports from it. Importing it
loads no torch: the bucket side (errors, stores, manifest, file headers) is torch-free, and the
tensor side (`Publisher`, `Replica`, `Bf16Snapshot`, ...) loads on first use, so the dashboard and
`python -m deltasync inspect` run without torch installed.

Its folders are layers, each importing only from those below it: `store/`, `wire/`, `kernels/`,
`codec/`, `publisher/` and `replica/`, `vllm_ext/`, `tools/` (README's layout table; checked by
tests/deltasync/test_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.errors import (
    ChainError,
    DeltaSyncError,
    DigestMismatch,
    FormatError,
    MissingExtra,
    PublishError,
    StoreError,
    import_tensor_side,
)
from deltasync.store import RetryPolicy, Store, open_store
from deltasync.wire.manifest import Manifest, read_manifest
from deltasync.wire.metrics import SyncRecord
from deltasync.wire.policy import AnchorPolicy

if TYPE_CHECKING:
    from deltasync.kernels.changes import Diff, TensorChange
    from deltasync.publisher.publisher import Publisher, PublisherConfig
    from deltasync.publisher.snapshot import Bf16Snapshot
    from deltasync.replica.replica import Replica
    from deltasync.replica.sinks import DictSink, Sink

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
    "Bf16Snapshot": "publisher.snapshot",
    "DictSink": "replica.sinks",
    "Diff": "kernels.changes",
    "Publisher": "publisher.publisher",
    "PublisherConfig": "publisher.publisher",
    "Replica": "replica.replica",
    "Sink": "replica.sinks",
    "TensorChange": "kernels.changes",
}


def __getattr__(name: str) -> Any:
    if name in _TENSOR_SIDE:
        return getattr(import_tensor_side(f"{__name__}.{_TENSOR_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
