"""Servers whose weights are not the bucket's bf16 bytes (or not where the layouts place them)
are refused when the transfer engine initialises, before any traffic: quantized serving, LoRA,
experts spread over data-parallel engines and experts moved while serving (load balancing),
each in one line naming the flag. Expert parallelism over the workers of one engine is served.

The configs are vLLM's own (`VllmConfig` with `quantization="fp8"`, with a `LoRAConfig`); the
engine is the one a worker builds from them.
"""

from __future__ import annotations

import pytest
import torch
from vllm_in_process import _restored_environ

from bench.models.families import build_family
from deltasync.errors import FormatError


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for family in ("llama", "qwen3-moe"):
        dirs[family] = tmp_path_factory.mktemp(family)
        build_family(family, dirs[family])
    return dirs


def _config(model_dir, **kwargs):
    from vllm.config import DeviceConfig, LoRAConfig, ModelConfig, ParallelConfig, VllmConfig

    lora = kwargs.pop("lora", False)
    parallel = kwargs.pop("parallel", {})
    with _restored_environ():
        model = ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            **kwargs,
        )
        return VllmConfig(
            model_config=model,
            device_config=DeviceConfig("cpu"),
            lora_config=LoRAConfig() if lora else None,
            parallel_config=ParallelConfig(**parallel),
        )


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({"quantization": "fp8"}, "--quantization"), ({"lora": True}, "--enable-lora")],
)
def test_init_refuses_in_one_line_naming_the_flag(model_dirs, tmp_path, kwargs, flag):
    from vllm.config import WeightTransferConfig

    from deltasync.vllm_ext.engine import DeltaSyncEngine

    config = _config(model_dirs["llama"], **kwargs)
    engine = DeltaSyncEngine(
        WeightTransferConfig(backend="deltasync"),
        config,
        torch.device("cpu"),
        torch.nn.Linear(1, 1),
    )
    info = engine.parse_init_info({"bucket": str(tmp_path / "bucket")})
    refusal = engine.init_refusal(info)
    assert refusal is not None and flag in refusal and "\n" not in refusal
    with pytest.raises(FormatError, match=flag):
        engine.init_transfer_engine(info)
    assert engine.store is None and engine.state is None  # nothing was set up


@pytest.mark.parametrize(
    ("parallel", "flag"),
    [
        ({"data_parallel_size": 2, "enable_expert_parallel": True}, "--enable-expert-parallel"),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "--enable-eplb"),
    ],
)
def test_experts_the_layouts_cannot_place_are_refused_naming_the_flag(model_dirs, parallel, flag):
    """The same line a worker's engine gives at init (its own test needs a TP group). vLLM
    takes --enable-eplb only on a GPU: the config gets it after it is built."""
    from deltasync.vllm_ext.engine import unsupported_serving

    config = _config(model_dirs["qwen3-moe"], parallel=parallel)
    config.parallel_config.enable_eplb = flag == "--enable-eplb"
    refusal = unsupported_serving(config)
    assert refusal is not None and flag in refusal and "\n" not in refusal


def test_plain_bf16_serving_is_accepted(model_dirs):
    from deltasync.vllm_ext.engine import unsupported_serving

    assert unsupported_serving(_config(model_dirs["llama"])) is None
    tp2 = {"tensor_parallel_size": 2}
    assert unsupported_serving(_config(model_dirs["qwen3-moe"], parallel=tp2)) is None
    ep2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    assert unsupported_serving(_config(model_dirs["qwen3-moe"], parallel=ep2)) is None
