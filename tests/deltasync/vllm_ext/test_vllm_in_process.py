"""vLLM's own Qwen3ForCausalLM on CPU, loaded by its load_weights: the layout the sinks assume.

The stand-in of test_device.py mirrors this layout; here it is vLLM's class itself: fused
`qkv_proj` / `gate_up_proj` stacked in `packed_modules_mapping` order with `output_sizes` rows,
the embedding padded to a multiple of 64 rows, the LM head tied (same parameter) or its own.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from gemm_paths import dispatch_empties_weights
from vllm_in_process import build_vllm_model, checkpoint_tensors, release_vllm_runtime

from deltasync.vllm_ext.apply.layout import LayoutOf
from trainer.random_qwen3 import build_tiny_qwen3, tiny_qwen3_config

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
CASES = {"tied": (300, True), "untied": (333, False)}  # vocab sizes not multiples of 64


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (checkpoint tensors, unpacked model, build seconds)."""
    out = {}
    for case, (vocab, tie) in CASES.items():
        directory = tmp_path_factory.mktemp(case)
        build_tiny_qwen3(directory, seed=1, vocab_size=vocab, tie=tie)
        start = time.perf_counter()
        model = build_vllm_model(directory)
        out[case] = (directory, checkpoint_tensors(directory), model, time.perf_counter() - start)
    yield out
    release_vllm_runtime()


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("case", CASES)
def test_is_vllms_class_with_plain_bf16_parameters(built, case):
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    _, _, model, seconds = built[case]
    assert type(model) is Qwen3ForCausalLM
    assert seconds < 60
    for name, p in params(model).items():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.numel() > 0, name
    assert model.packed_modules_mapping == PACKED


@pytest.mark.parametrize("case", CASES)
def test_fused_parameters_stack_the_checkpoint_members(built, case):
    _, ckpt, model, _ = built[case]
    config = tiny_qwen3_config()
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    for i, layer in enumerate(model.model.layers):
        hf = f"model.layers.{i}"
        attn, mlp = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert attn.output_sizes == [q, kv, kv]
        assert mlp.output_sizes == [config.intermediate_size] * 2
        members = [ckpt[f"{hf}.self_attn.{m}_proj.weight"] for m in "qkv"]
        assert same(attn.weight, torch.cat(members))
        members = [ckpt[f"{hf}.mlp.{m}_proj.weight"] for m in ("gate", "up")]
        assert same(mlp.weight, torch.cat(members))
        assert same(layer.self_attn.o_proj.weight, ckpt[f"{hf}.self_attn.o_proj.weight"])
        assert same(layer.mlp.down_proj.weight, ckpt[f"{hf}.mlp.down_proj.weight"])


@pytest.mark.parametrize("case", CASES)
def test_embedding_is_padded_to_64_rows_and_the_head_tied_or_not(built, case):
    _, ckpt, model, _ = built[case]
    vocab, tie = CASES[case]
    embed = model.model.embed_tokens.weight
    padded = -(-vocab // 64) * 64
    assert padded > vocab and embed.shape == (padded, 64)
    assert same(embed[:vocab], ckpt["model.embed_tokens.weight"])
    assert not embed[vocab:].any()  # vLLM zeroes the padding rows
    head = model.lm_head.weight
    assert head.shape == embed.shape
    if tie:
        assert "lm_head.weight" not in ckpt
        assert head is embed
        assert "lm_head.weight" not in dict(model.named_parameters())  # deduplicated
    else:
        assert head is not embed and head.data_ptr() != embed.data_ptr()
        assert same(head[:vocab], ckpt["lm_head.weight"])
        assert not head[vocab:].any()


@pytest.mark.parametrize("case", CASES)
def test_layout_read_off_the_loaders_maps_every_checkpoint_tensor_onto_its_bits(built, case):
    _, ckpt, model, _ = built[case]
    layout = LayoutOf(model, model.vllm_config)({n: tuple(t.shape) for n, t in ckpt.items()})
    placements = layout.exact()
    assert set(placements) == set(ckpt)
    served = params(model)
    for name, placement in placements.items():
        flat = served[placement.param_name].data.view(-1)
        run = flat[placement.offset : placement.offset + placement.box.numel]
        assert same(run.view(ckpt[name].shape), ckpt[name]), name
    k = placements["model.layers.1.self_attn.k_proj.weight"]
    assert (k.param_name, k.offset) == ("model.layers.1.self_attn.qkv_proj.weight", 64 * 64)
    up = placements["model.layers.0.mlp.up_proj.weight"]
    assert (up.param_name, up.offset) == ("model.layers.0.mlp.gate_up_proj.weight", 128 * 64)


def test_load_weights_rewrites_a_fused_group_in_place(built):
    _, ckpt, model, _ = built["untied"]
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    ptr = qkv.data_ptr()
    group = [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv"]
    try:
        model.load_weights([(name, -ckpt[name]) for name in group])
        assert qkv.data_ptr() == ptr
        assert same(qkv, torch.cat([-ckpt[name] for name in group]))
    finally:
        model.load_weights([(name, ckpt[name]) for name in group])
    assert same(qkv, torch.cat([ckpt[name] for name in group]))


@pytest.mark.parametrize("case", CASES)
def test_packed_variant_is_what_a_vllm_cpu_server_holds(built, case, gemm_path):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from deltasync.vllm_ext.apply.swap import CpuGemmSwapper

    directory, ckpt, plain, _ = built[case]
    env = dict(os.environ)
    model = build_vllm_model(directory, packed=True)
    assert dict(os.environ) == env  # vLLM's CPU platform writes LD_PRELOAD etc.; restored
    served = params(model)
    qkv = served["model.layers.0.self_attn.qkv_proj.weight"]
    if dispatch_empties_weights():
        assert qkv.numel() == 0
    else:  # the fallback GEMM keeps the loaded values in `.weight`
        assert same(qkv, plain.model.layers[0].self_attn.qkv_proj.weight)
    assert callable(model.model.layers[0].self_attn.qkv_proj.cpu_linear)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out, _ = model.model.layers[0].self_attn.qkv_proj(x)
    expected = torch.nn.functional.linear(x, plain.model.layers[0].self_attn.qkv_proj.weight)
    assert same(out, expected)
    swapper = CpuGemmSwapper(
        model, LayoutOf(model, model.vllm_config), dispatch_cpu_unquantized_gemm
    )
    assert swapper.self_check(ckpt) == []
