"""Content digests: xxh3-128 of files and of tensors' bf16 bytes (~10 GB/s, run on every sync).

Torch-free at import: bucket readers (the dashboard, `inspect`) only need `bytes_digest`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

__all__ = ["DIGEST_ALGORITHM", "bytes_digest", "tensor_digest"]

DIGEST_ALGORITHM = "xxh3-128"


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex xxh3-128 of a CPU tensor's raw bytes in row-major order (no copy when contiguous)."""
    import torch  # the caller holds a tensor, so torch is loaded already

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy())


def bytes_digest(data: bytes | memoryview) -> str:
    """Hex xxh3-128 of a byte string (used for whole files in the manifest)."""
    return xxhash.xxh3_128_hexdigest(data)
