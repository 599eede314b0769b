"""Per-tensor digests of bf16 bytes: xxh3-128, cheap enough to run on every sync (~10 GB/s)."""

from __future__ import annotations

import torch
import xxhash

__all__ = ["DIGEST_ALGORITHM", "bytes_digest", "tensor_digest"]

DIGEST_ALGORITHM = "xxh3-128"


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex xxh3-128 of a CPU tensor's raw bytes in row-major order (no copy when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy())


def bytes_digest(data: bytes | memoryview) -> str:
    """Hex xxh3-128 of a byte string (used for whole files in the manifest)."""
    return xxhash.xxh3_128_hexdigest(data)
