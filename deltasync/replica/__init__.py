"""Layer 5, the reading side: one chain replay that every reader shares (`replay`, torch-free),
the planning of a sync from the manifest, with a driven sync's named delta read beside it
(`driven`, torch-free), and the replica and its sinks (`replica`). May import every layer below
(`errors`, `defaults`, `store`, `wire`, `kernels`, `codec`); `deltasync.Replica` is
`replica.Replica`.
"""
