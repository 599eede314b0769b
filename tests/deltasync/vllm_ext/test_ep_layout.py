"""Expert parallelism over the workers of one engine (TP 2 with `--enable-expert-parallel`):
each worker's layout, read off vLLM's own loaders on a twin built with that worker's expert map,
places its experts whole, the other worker's as empty boxes it does not own, and the owned boxes
of both workers tile every tensor exactly once.

One process plays both workers: vLLM's tensor-parallel rank and size are read from its TP group
when the model is built and loaded, so a stand-in group answers rank 0, then rank 1, of 2. The
served model of each rank is built on the host (the tiny Qwen3-MoE, 8 experts: 4 a worker).
"""

from __future__ import annotations

import re

import pytest
import torch
from vllm_in_process import _restored_environ, ensure_vllm_runtime, vllm_config_for

from bench.models.families import build_family
from deltasync.errors import FormatError
from deltasync.kernels.boxes import check_cover

SIZE = 2
EXPERT = re.compile(r"\.experts\.(\d+)\.")


class _StandInGroup:
    """vLLM's TP group as rank `rank` of `SIZE` sees it; everything else from the real one."""

    def __init__(self, real, rank: int):
        self.real, self.rank_in_group, self.world_size = real, rank, SIZE

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe")
    build_family("qwen3-moe", folder)
    return folder


@pytest.fixture(scope="module")
def ep_config(model_dir):
    with _restored_environ():
        config = vllm_config_for(model_dir)
        ensure_vllm_runtime(config)
    config.parallel_config.tensor_parallel_size = SIZE
    config.parallel_config.enable_expert_parallel = True
    return config


@pytest.fixture
def as_rank(monkeypatch):
    from vllm.distributed import parallel_state

    real = parallel_state._TP

    def enter(rank: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", _StandInGroup(real, rank))

    return enter


def _served(config):
    """The model a worker of `config` serves (host tensors, uninitialised values), registered
    in a copy of the config (each rank's model registers the same layer names)."""
    import copy

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = copy.copy(config)
    config.compilation_config = copy.copy(config.compilation_config)
    config.compilation_config.static_forward_context = {}
    config.compilation_config.static_all_moe_layers = []
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        return initialize_model(vllm_config=config, model_class=Qwen3MoeForCausalLM)


def _shapes(model_dir):
    from safetensors import safe_open

    shapes = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            shapes.update((k, tuple(f.get_slice(k).get_shape())) for k in list(f.keys()))
    return shapes


def test_each_worker_places_its_experts_and_the_two_cover_every_tensor_once(
    model_dir, ep_config, as_rank
):
    from deltasync.vllm_ext.apply.layout import LayoutOf

    shapes = _shapes(model_dir)
    experts = {n: int(m[1]) for n in shapes if (m := EXPERT.search(n))}
    assert experts and max(experts.values()) == 7
    workers = []
    for rank in range(SIZE):
        as_rank(rank)
        served = _served(ep_config)
        layout = LayoutOf(served, ep_config, tp=(rank, SIZE))(shapes)
        placements = layout.exact()  # nothing refused: every tensor placed, here or elsewhere
        assert placements.keys() == shapes.keys()
        for name, expert in experts.items():
            box = placements[name].box
            mine = expert // 4 == rank  # vLLM's linear placement: 4 experts a worker
            assert (box.is_whole, box.owner, box.numel > 0) == (mine, mine, mine), name
        for module, members in layout.groups.items():  # a layerwise reload: this worker's only
            held = {experts[n] // 4 for n in members if n in experts}
            assert held <= {rank}, module
        workers.append({n: p.box for n, p in placements.items()})
    check_cover(workers, shapes)
    router = next(n for n in shapes if n.endswith("mlp.gate.weight"))
    assert [w[router].owner for w in workers] == [True, False]  # held whole by both


def test_a_twin_whose_experts_sit_elsewhere_than_the_served_ones_is_refused(ep_config, as_rank):
    from deltasync.vllm_ext.apply.layout import meta_twin

    as_rank(0)
    served = _served(ep_config)
    layer = next(m for m in served.modules() if getattr(m, "expert_map_manager", None))
    moved = layer.expert_map_manager.expert_map.roll(4)  # the other worker's experts
    layer.expert_map_manager._expert_map = moved  # as load balancing would move them
    with pytest.raises(FormatError, match="--enable-eplb"):
        meta_twin(served, ep_config)
