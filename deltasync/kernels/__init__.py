"""Layer 3, numeric kernels on tensors: the change scan, bf16 bit views, the full-state digest's
sums and a box's share of a tensor.

May import: `deltasync.errors`, `deltasync.defaults`, `deltasync.store`, `deltasync.wire`.
"""
