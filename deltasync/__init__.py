"""deltasync: bf16 weight deltas for async RL, published through an object-storage bucket."""

from .errors import (
    ChainError,
    DeltaSyncError,
    DigestMismatch,
    FormatError,
    PublishError,
    StoreError,
)
from .policy import AnchorPolicy
from .publisher import Publisher, PublisherConfig, SyncRecord
from .replica import Replica, StagedUpdate, read_manifest
from .snapshot import Bf16Snapshot, Diff, TensorChange
from .store import Store, open_store

__all__ = [
    "AnchorPolicy",
    "Bf16Snapshot",
    "ChainError",
    "DeltaSyncError",
    "Diff",
    "DigestMismatch",
    "FormatError",
    "PublishError",
    "Publisher",
    "PublisherConfig",
    "Replica",
    "StagedUpdate",
    "Store",
    "StoreError",
    "SyncRecord",
    "TensorChange",
    "open_store",
    "read_manifest",
]
