"""Layer 5, the reading side: one chain replay that every reader shares (`replay`, torch-free),
the replica and its sinks (`replica`), and ranged reads of only the pieces a reader holds.

May import: every layer below (`errors`, `defaults`, `store`, `wire`, `kernels`, `codec`).
`Replica`, `DictSink` and `Sink` load the tensor side on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.errors import import_tensor_side

if TYPE_CHECKING:
    from deltasync.replica.replica import DictSink, Replica, Sink

__all__ = ["DictSink", "Replica", "Sink"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_tensor_side(f"{__name__}.replica"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
