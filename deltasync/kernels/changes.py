"""The types change detection produces and the codec consumes: per-tensor changes and a diff.

A small module of its own so the codec and the replica never import the trainer-side snapshot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["WORKERS", "Diff", "TensorChange", "gather", "scatter"]

WORKERS = max(2, min(8, os.cpu_count() or 2))  # the compiled scan, xxhash and zstd release the GIL


@dataclass(frozen=True)
class TensorChange:
    """The elements of one tensor whose bf16 bits changed.

    Attributes:
        indices: int64, strictly ascending flat (row-major) indices.
        values: bf16, the new values at those indices.
        previous: bf16, the values at the base version (what value-difference codecs need).
    """

    indices: torch.Tensor
    values: torch.Tensor
    previous: torch.Tensor


@dataclass(frozen=True)
class Diff:
    """What changed between the last published snapshot and the current weights.

    `changes` holds only tensors with at least one changed element; `digests` covers every tensor
    (the post-update bf16 bytes) so a reader can verify the full state after applying; it is
    empty for a rank's boxes of sharded parameters, which are no whole tensors.
    """

    changes: dict[str, TensorChange]
    digests: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    @property
    def total_elements(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes.values())

    @property
    def changed_elements(self) -> int:
        return sum(c.indices.numel() for c in self.changes.values())

    @property
    def density(self) -> float:
        total = self.total_elements
        return self.changed_elements / total if total else 0.0


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The int16 bit patterns of a contiguous bf16 CPU tensor, flat, sharing its memory."""
    return tensor.reshape(-1).view(torch.int16).numpy()


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Elements of a contiguous bf16 tensor at flat indices (numpy: torch's `t[idx]` is slower)."""
    return torch.from_numpy(bits(tensor)[indices.numpy()]).view(torch.bfloat16)


def scatter(tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """In place: `tensor.view(-1)[indices] = values` for a contiguous bf16 CPU tensor."""
    bits(tensor)[indices.numpy()] = values.view(torch.int16).numpy()
