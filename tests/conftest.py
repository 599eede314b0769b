"""Shared fixtures: a tiny random Qwen3 built offline and a trainer-like AdamW loop."""

from __future__ import annotations

import pytest
import torch


def tiny_qwen3(seed: int = 0, *, tie: bool = True):
    """A 2-layer Qwen3 (head_dim 32, vocab 512) with std-0.02 init and fp32 master weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=0.02,
    )
    return Qwen3ForCausalLM(config).float()


class AdamWLoop:
    """Real optimizer steps on a language-modelling loss over random token sequences."""

    def __init__(self, model: torch.nn.Module, lr: float, seed: int = 0):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (2, 32), generator=self.generator)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@pytest.fixture
def tiny_model():
    return tiny_qwen3()
