"""Layer 5, the trainer's side: change detection (host or device), checkpoint names, sharded
parts and the publisher that encodes, uploads and commits each version (`deltasync.Publisher` is
`publisher.Publisher`). May import every layer below (`errors`, `defaults`, `store`, `wire`,
`kernels`, `codec`) and `deltasync.replica` (a takeover replays the bucket as a replica does).
"""
