"""`device_sum`, the digest a GPU replica runs over its served parameters, in bounded chunks:
the same sums whatever the chunk size, no buffer larger than a chunk's lanes, and its constants
built once per device rather than every chunk or call (issue 30, finding 7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deltasync.kernels import state_hash
from deltasync.kernels.state_hash import device_sum, indexed_sum, tensor_sum

LANE_BYTES = 4 * 8  # four int64 lanes per element


def _bf16(seed: int, *shape: int) -> torch.Tensor:
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


class _LargestBuffer(TorchDispatchMode):
    """The largest storage any op allocates (outputs sharing an input's storage are views)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("chunk", [1, 7, 1000, 4096, 1 << 22])
def test_any_chunk_size_gives_the_host_digest(chunk):
    t = _bf16(0, 64, 67)  # 4288 elements: most chunk sizes do not divide it
    start = 2**31 - 2000  # chunks straddle the 2^31 index boundary
    assert device_sum("w", t, start=start, chunk=chunk) == tensor_sum("w", t, start=start)
    index = torch.from_numpy(np.random.default_rng(1).choice(1 << 40, t.numel(), replace=False))
    assert device_sum("w", t, index=index, chunk=chunk) == indexed_sum("w", index, t)


def test_chunk_size_outside_its_bounds_is_refused():
    t = _bf16(2, 10)
    for chunk in (0, -1, (1 << 22) + 1):
        with pytest.raises(ValueError, match="chunk"):
            device_sum("w", t, chunk=chunk)


def test_no_buffer_outgrows_a_chunk_whatever_the_tensor_size():
    """The default chunk bounds the transient: a tensor of 2^21 elements (twice the default
    chunk) allocates nothing larger than one chunk's four int64 lanes, nor does a tensor
    digested in small chunks, with its index on the host."""
    t = _bf16(3, (1 << 21) + 5)
    with _LargestBuffer() as seen:
        found = device_sum("big", t)
    assert found == tensor_sum("big", t)
    assert seen.bytes <= LANE_BYTES * (1 << 20)
    small = t[:50_000]
    index = torch.arange(small.numel(), dtype=torch.int64) * 3
    with _LargestBuffer() as seen:
        found = device_sum("big", small, index=index, chunk=1000)
    assert found == indexed_sum("big", index, small)
    assert seen.bytes <= LANE_BYTES * 1000


def test_lane_constants_are_built_once_per_device_not_per_chunk_or_call(monkeypatch):
    t = _bf16(4, 5000)
    expected = tensor_sum("w", t)
    assert device_sum("w", t) == expected  # the first call on this device builds them
    built: list[object] = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(a) or tensor(*a, **k))
    assert device_sum("w", t) == expected
    assert device_sum("w", t[:100], start=7) == tensor_sum("w", t[:100], start=7)
    assert built == []  # nothing uploaded again on a later call
    assert device_sum("w", t, chunk=100) == expected  # fifty chunks
    assert built == []
    assert device_sum("other", t, chunk=100) == tensor_sum("other", t)
    assert len(built) == 1  # another tensor's keys, once
    assert state_hash._lane_constants.cache_info().currsize == 1  # one device: the CPU
