"""Synthetic bf16 steps for shapes too large to train here: a std-0.02 init, then per step a
chosen share of elements moved by a few bit-pattern steps (89 % by exactly one, as measured on
realistic deltas). Index sets are uniform, so payloads sit near the entropy floor; use
`realistic` for sizes, this for timings and memory at scale.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from .models.qwen3 import MOE_SHAPES, SHAPES, Shape

__all__ = ["parameter_shapes", "publish_synthetic", "synthetic_states"]


def parameter_shapes(shape: Shape | str) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 (or Qwen3-MoE: one tensor per expert and
    projection, as `save_pretrained` writes them) of this shape (tied aliases skipped)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from .models.qwen3 import build_config

    if isinstance(shape, str):
        shape = (SHAPES | MOE_SHAPES)[shape]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(shape))
        held = {name: torch.empty(p.shape) for name, p in model.named_parameters()}
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, held).items()}


def synthetic_states(
    shape: Shape | str, steps: int, *, density: float = 0.02, seed: int = 0
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(0, initial bf16 state), then (k, state after step k); the dict is updated in place."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, dims in parameter_shapes(shape).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
    yield 0, state
    for k in range(1, steps + 1):
        for tensor in state.values():
            bits = tensor.view(-1).view(torch.int16).numpy()
            count = max(1, round(density * bits.size))
            index = np.unique(rng.integers(0, bits.size, count))
            size = rng.choice([1, 2, 3], index.size, p=[0.89, 0.08, 0.03]).astype(np.int16)
            bits[index] += size * rng.choice(np.array([-1, 1], np.int16), index.size)
        yield k, state


def publish_synthetic(
    bucket: str | os.PathLike,
    shape: Shape | str,
    steps: int,
    *,
    density: float,
    run_id: str,
    **config,
) -> int:
    """Publish the anchor and `steps` synthetic deltas to a folder bucket; the state's bytes."""
    from deltasync import Publisher, PublisherConfig, open_store

    with Publisher(open_store(str(bucket)), PublisherConfig(run_id=run_id, **config)) as publisher:
        for _, state in synthetic_states(shape, steps, density=density):
            publisher.publish(state).result(timeout=3600)
    return sum(t.numel() * 2 for t in state.values())
