"""Layer 2, the wire format: what a bucket holds, read and written without torch.

One module per section of `bucket_layout.md`: file headers (`header`), file metadata
(`metadata`), the manifest and chain planning (`manifest`), sync records (`metrics`), the two
digests (`digests`), a virtual anchor's source record (`source`), fencing, garbage collection,
the anchor policy, and the strict field checks every record shares (`fields`).

May import: `deltasync.errors`, `deltasync.defaults`, `deltasync.store`; never torch.
"""
