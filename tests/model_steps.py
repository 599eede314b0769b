"""Test helpers: the tiny Qwen3 and real AdamW steps on it (`from model_steps import ...`)."""

from __future__ import annotations

import torch


def tiny_qwen3(seed: int = 0, *, tie: bool = True):
    """The project's tiny Qwen3 (2 layers, head_dim 32) with std-0.02 init, fp32 weights."""
    from transformers import Qwen3ForCausalLM

    from trainer.tiny_model import tiny_qwen3_config

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(tie=tie)).float()


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
