"""Anchor and delta files: a symmetric encode/decode API over safetensors.

Anchors are plain HF-style bf16 checkpoints, or virtual anchors naming one; deltas use the `ctx`
(default), `ans`, `packed` or `coo` encoding.
Layer 4. A torch-free facade: headers and metadata are `deltasync.wire`'s, re-exported here;
`encode_*` and `decode` load the tensor side (`files`) on first use. May import every layer
below (`errors`, `defaults`, `store`, `wire`, `kernels`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.errors import import_tensor_side
from deltasync.wire.metadata import (
    ENCODINGS,
    PROTOCOL,
    FileMetadata,
    ParsedFile,
    ParsedParts,
    PartInfo,
    check_tiling,
    read_metadata,
)

if TYPE_CHECKING:
    from deltasync.codec.files import (
        DecodedFile,
        decode,
        encode_anchor,
        encode_delta,
        encode_virtual_anchor,
    )

__all__ = [
    "ENCODINGS",
    "PROTOCOL",
    "DecodedFile",
    "FileMetadata",
    "ParsedFile",
    "ParsedParts",
    "PartInfo",
    "check_tiling",
    "decode",
    "encode_anchor",
    "encode_delta",
    "encode_virtual_anchor",
    "read_metadata",
]

_TENSOR_SIDE = {"DecodedFile", "decode", "encode_anchor", "encode_delta", "encode_virtual_anchor"}


def __getattr__(name: str) -> Any:
    if name in _TENSOR_SIDE:
        return getattr(import_tensor_side(f"{__name__}.files"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
