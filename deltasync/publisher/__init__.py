"""Layer 5, the trainer's side: change detection (host or device), checkpoint names, sharded
parts and the publisher that encodes, uploads and commits each version.

May import: every layer below (`errors`, `defaults`, `store`, `wire`, `kernels`, `codec`) and
`deltasync.replica` (a new run checks its first version the way a replica reads it).
"""

from deltasync.publisher.publisher import Publisher, PublisherConfig

__all__ = ["Publisher", "PublisherConfig"]
