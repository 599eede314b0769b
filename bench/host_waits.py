"""The operations of a torch program that make the host wait for a GPU, counted on any device.

A CUDA kernel launch returns at once; the host waits only when it needs a value back: a result
whose size depends on values (`nonzero`, `masked_select`, indexing by a mask), a number read out
(`.item()`, `bool(tensor)`), a copy to the host. Counting these operations on CPU tensors tells how
often the same code would wait on a GPU, without one. Copies to the host are not counted here
(on the CPU they are no copies): pass a counting `to_host` to the code under test.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostWaits"]

_aten = torch.ops.aten
WAITS = frozenset(
    {_aten.nonzero.default, _aten.masked_select.default, _aten._local_scalar_dense.default}
)


class HostWaits(TorchDispatchMode):
    """`with HostWaits() as waits: ...` then `waits.count`: the waiting operations run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        by_mask = func is _aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        self.count += func in WAITS or by_mask
        return func(*args, **(kwargs or {}))
