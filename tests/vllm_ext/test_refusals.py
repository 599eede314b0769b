"""Servers whose weights are not the bucket's bf16 bytes are refused when the transfer engine
initialises, before any traffic: quantized serving and LoRA, each in one line naming the flag.

The configs are vLLM's own (`VllmConfig` with `quantization="fp8"`, with a `LoRAConfig`); the
engine is the one a worker builds from them.
"""

from __future__ import annotations

import pytest
import torch
from vllm_qwen3 import _restored_environ

from bench.families import build_family
from deltasync.errors import FormatError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_family("llama", directory)
    return directory


def _config(model_dir, **kwargs):
    from vllm.config import DeviceConfig, LoRAConfig, ModelConfig, VllmConfig

    lora = kwargs.pop("lora", False)
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
        )


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({"quantization": "fp8"}, "--quantization"), ({"lora": True}, "--enable-lora")],
)
def test_init_refuses_in_one_line_naming_the_flag(model_dir, tmp_path, kwargs, flag):
    from vllm.config import WeightTransferConfig

    from deltasync.vllm_ext.engine import DeltaSyncEngine

    config = _config(model_dir, **kwargs)
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


def test_plain_bf16_serving_is_accepted(model_dir, tmp_path):
    from deltasync.vllm_ext.engine import unsupported_serving

    assert unsupported_serving(_config(model_dir)) is None
