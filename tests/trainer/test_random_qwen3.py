"""The offline tiny Qwen3: a checkpoint transformers (and vLLM) load as is, with a chat template."""

from __future__ import annotations

import json

import torch

from deltasync.publisher.snapshot import Bf16Snapshot
from trainer.random_qwen3 import build_tiny_qwen3


def test_checkpoint_tokenizer_and_trainer_copy(tmp_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    model = build_tiny_qwen3(tmp_path, seed=3)
    assert next(model.parameters()).dtype == torch.float32  # the trainer's fp32 master copy
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["head_dim"] >= 32 and config["tie_word_embeddings"]
    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    expected = Bf16Snapshot.capture(model).tensors
    for name, tensor in Bf16Snapshot.capture(loaded).tensors.items():
        assert torch.equal(tensor.view(torch.int16), expected[name].view(torch.int16)), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "guess: crane ✓"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nguess: crane ✓<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < config["vocab_size"] and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
