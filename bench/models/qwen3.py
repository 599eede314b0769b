"""Qwen3 models built from `transformers.Qwen3Config` (no download), fp32 with the config's init.

- `SHAPES` (selectable by name) for the benchmarks:
  - `qwen3-0.6b`: Qwen3-0.6B exactly (hidden 1024, 28 layers, 16 heads, 8 kv heads, head_dim 128,
    intermediate 3072, vocab 151936, tied embeddings): 596M parameters, 1.19 GB bf16.
  - `qwen3-1.7b`: Qwen3-1.7B exactly (hidden 2048, intermediate 6144, otherwise as 0.6B):
    1.72B parameters, 3.44 GB bf16.
  - `qwen3-100m`: hidden 768, 12 layers, 12 heads, 4 kv heads, head_dim 64, intermediate 3072,
    vocab 32000, tied embeddings: 128M parameters, 0.26 GB bf16 (quick runs).
  - `qwen3-tiny`: hidden 128, 2 layers, vocab 4096 (smoke tests only).
- `MOE_SHAPES`, Qwen3-MoE (`Shape.experts` routed experts per layer, top 8) for the benchmarks
  that only need tensor shapes (`bench.synthetic`):
  - `qwen3-30b-a3b-2l`: Qwen3-30B-A3B's shapes (hidden 2048, 32 heads, 4 kv heads, head_dim
    128, 128 experts of intermediate 768, vocab 151936, untied) with 2 of its 48 layers:
    1.87B parameters, 3.74 GB bf16, 65 % of them in experts.
  - `qwen3-moe-tiny`: hidden 128, 2 layers, 8 experts of intermediate 64 (smoke tests only).
- `tiny_qwen3`: the tests' in-memory Qwen3, the local run's `tiny` preset (2 layers, head_dim 32,
  std-0.02 init); `uneven_qwen3` the same with an odd vocabulary and an untied head (uneven row
  shards for the FSDP2 tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MOE_SHAPES",
    "SHAPES",
    "Shape",
    "build_config",
    "build_model",
    "tiny_qwen3",
    "uneven_qwen3",
]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    experts: int = 0  # routed experts per layer (Qwen3-MoE); 0: a dense MLP
    expert_intermediate: int = 0


SHAPES: dict[str, Shape] = {
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151936),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-100m": Shape(768, 12, 12, 4, 64, 3072, 32000),
    "qwen3-tiny": Shape(128, 2, 4, 2, 32, 384, 4096),
}
MOE_SHAPES: dict[str, Shape] = {
    "qwen3-30b-a3b-2l": Shape(2048, 2, 32, 4, 128, 6144, 151936, False, 128, 768),
    "qwen3-moe-tiny": Shape(128, 2, 4, 2, 32, 384, 4096, True, 8, 64),
}


def build_config(shape: Shape):
    """The `transformers.Qwen3Config` of a shape (std-0.02 init, tied embeddings by default),
    a `Qwen3MoeConfig` (every layer sparse) when it has experts."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        initializer_range=0.02,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    if not shape.experts:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=shape.experts,
        num_experts_per_tok=min(8, shape.experts),
        moe_intermediate_size=shape.expert_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def build_model(shape: Shape | str, *, seed: int = 0) -> torch.nn.Module:
    """A Qwen3ForCausalLM of this shape, fp32, std-0.02 normal init (HF `_init_weights`)."""
    from transformers import Qwen3ForCausalLM

    if isinstance(shape, str):
        shape = SHAPES[shape]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(build_config(shape)).float()
    model.train()
    return model


def tiny_qwen3(seed: int = 0, *, tie: bool = True) -> torch.nn.Module:
    """The local run's `tiny` Qwen3 (2 layers, head_dim 32) with std-0.02 init, fp32 weights."""
    from transformers import Qwen3ForCausalLM

    from trainer.random_qwen3 import tiny_qwen3_config

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(tie=tie)).float()


def uneven_qwen3(vocab: int, intermediate: int, seed: int) -> torch.nn.Module:
    """The tiny Qwen3 with an odd vocabulary (uneven row shards) and an untied LM head."""
    from transformers import Qwen3ForCausalLM

    from trainer.random_qwen3 import tiny_qwen3_config

    config = tiny_qwen3_config(vocab, tie=False)
    config.intermediate_size = intermediate
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()
