"""`python -m deltasync warm-up`: compile the codec's loops before a run needs them.

The hot loops are numba functions cached on disk (`kernels.jit`); on a fresh install the first
delta a trainer encodes, and the first a replica decodes, compile them first - about 15 s on two
cores, during which the first versions queue up and are superseded. `warm_up` runs the whole
path once on a few small tensors - publish an anchor and a delta through a temporary folder
bucket, sync a replica, compare bitwise - so every loop either path runs is compiled and cached
by the time the run's first version is. `launch.py --local` runs it while the replicas start.
"""

from __future__ import annotations

import tempfile
import time

import torch

from deltasync.defaults import ENCODING
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.store import open_store

__all__ = ["warm_up"]

_SHAPES = {"embed": (512, 64), "proj.weight": (64, 64), "norm.weight": (64,)}


def warm_up(encoding: str = ENCODING, seed: int = 0) -> float:
    """Publish and sync two versions with `encoding`; returns the seconds it took.

    Raises:
        RuntimeError: the replica's tensors differ from what was published.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in _SHAPES.items()
    }
    with tempfile.TemporaryDirectory(prefix="deltasync-warm-up-") as folder:
        store = open_store(folder)
        config = PublisherConfig(run_id="warm-up", encoding=encoding)
        with Publisher(store, config) as publisher:
            publisher.publish(weights).result(timeout=600)
            for tensor in weights.values():  # about 1 element in 8 moves by one ulp
                flat = tensor.view(torch.int16).view(-1)
                flat[::8] += 1
            publisher.publish(weights).result(timeout=600)
        replica = Replica()
        replica.sync(store)
        for name, tensor in weights.items():
            if not torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16)):
                raise RuntimeError(f"warm-up: the replica's {name} differs from the published")
    return time.perf_counter() - started
