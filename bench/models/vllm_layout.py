"""vLLM's Qwen3 parameter layout (tensor parallel 1) without vLLM, for the in-place sink.

What the in-place path relies on: `qkv_proj` / `gate_up_proj` parameters with `output_sizes`,
an embedding padded to a multiple of 64 rows, an LM head that shares
the embedding's parameter, and a `load_weights` that copies checkpoint tensors into them as
vLLM's loaders do (narrow, then `copy_`), from which `standin_layout` derives the layout the
sinks use, as the engine does from a real vLLM model. Used by the tests and by the GPU check
(`bench.gpu`), which runs where vLLM is not installed; every weight starts at SENTINEL so
unwritten rows stand out.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SENTINEL", "StandInQwen3", "standin_layout"]

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
SENTINEL = -7.0  # fills padding rows; must never be written


def _param(rows: int, cols: int | None = None) -> nn.Parameter:
    shape = (rows,) if cols is None else (rows, cols)
    return nn.Parameter(torch.full(shape, SENTINEL, dtype=torch.bfloat16), requires_grad=False)


class Fused(nn.Module):
    def __init__(self, output_sizes: list[int], cols: int):
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = _param(sum(output_sizes), cols)


class Plain(nn.Module):
    def __init__(self, rows: int, cols: int | None = None):
        super().__init__()
        self.weight = _param(rows, cols)


class StandInQwen3(nn.Module):
    """vLLM's Qwen3ForCausalLM parameter layout (tensor parallel 1), weights set to SENTINEL."""

    def __init__(self, config, pad_to: int = 64):
        super().__init__()
        self.config = config
        h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        padded = -(-config.vocab_size // pad_to) * pad_to
        self.model = nn.Module()
        self.model.embed_tokens = Plain(padded, h)
        self.model.layers = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = Fused([q, kv, kv], h)
            layer.self_attn.o_proj = Plain(h, q)
            layer.self_attn.q_norm = Plain(hd)
            layer.self_attn.k_norm = Plain(hd)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = Fused([inter, inter], h)
            layer.mlp.down_proj = Plain(h, inter)
            layer.input_layernorm = Plain(h)
            layer.post_attention_layernorm = Plain(h)
            self.model.layers.append(layer)
        self.model.norm = Plain(h)
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight  # tied

    def load_weights(self, weights) -> set[str]:
        """Copy `(hf_name, tensor)` pairs into the fused parameters (vLLM's way: narrow, copy)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            parts = name.split(".")
            target, shard = name, None
            for fused, members in PACKED.items():
                if parts[-2] in members:
                    target = ".".join([*parts[:-2], fused, parts[-1]])
                    shard = members.index(parts[-2])
            param = params[target]
            if shard is None:
                param.data[: tensor.shape[0]].copy_(tensor)
            else:
                sizes = self.get_submodule(target.rpartition(".")[0]).output_sizes
                param.data.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
            loaded.add(target)
        return loaded


def standin_layout(config):
    """The sinks' `layout` argument for a `StandInQwen3` of `config`: derived from its loader
    on a meta twin, as the engine derives it from vLLM's."""
    from deltasync.vllm_ext.apply.layout import layout_from_writes, record_writes

    with torch.device("meta"):
        twin = StandInQwen3(config)

    def layout(shapes):
        return layout_from_writes(*record_writes(twin, shapes), shapes)

    return layout
