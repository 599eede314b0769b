"""Where each element of each checkpoint tensor lands in the served model, read off vLLM itself.

No table of model families here: the served model's own `load_weights` decides. A twin of the
served model is built on the meta device (no memory, the live model untouched, so this runs
while it serves), and its `load_weights` is handed meta tensors of the checkpoint's names and
shapes. A dispatch mode records every `copy_` a weight loader makes: which parameter it writes,
at which offset and shape, and which part of which checkpoint tensor it reads. That covers
whatever the family's loader does (`hf_to_vllm_mapper`, fused q/k/v and gate/up shards, MoE
experts stacked into `w13_weight` / `w2_weight`, tensor-parallel boxes, expert-parallel
subsets, padded vocabularies, tied heads) in the loader's own terms.

A placement is exact or refused: a tensor must be copied once, from a box of its rows (and
columns) into a contiguous run of one parameter; one that a loader transforms (casts, adds,
transposes), splits over several parameters, or that the served model does not load at all is
refused in one line naming it (`placements`). Under expert parallelism a worker's loaders
decline the experts another worker holds (vLLM's expert map says where each one is; the twin is
built with this worker's map and checked against the served one): such a tensor is placed as an
empty box, and the worker holding it owns its elements. Sinks use what they need: the in-place sink
writes changes at `Placement.offset` (the loader's layout, before any post-load transform); the
CPU shadow sink reloads `Layout.groups` - every checkpoint tensor of each touched module - through
vLLM's own load and `process_weights_after_loading`.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box

__all__ = [
    "Layout",
    "LayoutOf",
    "Placement",
    "derive_layout",
    "meta_twin",
    "record_writes",
    "with_owners",
]

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Placement:
    """Box `box` of checkpoint tensor `hf_name` is held, row-major, at flat elements
    `[offset, offset + box.numel)` of parameter `param_name` (of module `module_name`)."""

    hf_name: str
    param_name: str
    module_name: str
    box: Box
    offset: int


@dataclass(frozen=True)
class Write:
    """One `copy_` of a weight loader, as geometry: destination parameter view and source
    checkpoint-tensor view (offset, shape, stride each)."""

    param: str
    dst: tuple[int, tuple[int, ...], tuple[int, ...]]
    source: str | None  # None: the source was not a view of a checkpoint tensor
    src: tuple[int, tuple[int, ...], tuple[int, ...]]
    dtypes: tuple[torch.dtype, torch.dtype]


@dataclass
class Layout:
    """The served model's layout for checkpoint tensors of given shapes.

    `placements`: the tensors this worker holds (an empty box: another worker's); `groups`: the
    served module -> every checkpoint tensor its loaders read (the unit of a layerwise reload);
    `param_shapes`: each parameter's shape as the loaders fill it (before post-load repacking);
    `problems`: tensors that cannot be placed exactly, `name: why`.
    """

    placements: dict[str, Placement] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    def exact(self) -> dict[str, Placement]:
        """The placements; raises for the first tensor that has none.

        Raises:
            FormatError: naming the tensor and why it cannot be written in place.
        """
        for name, why in sorted(self.problems.items()):
            raise FormatError(why, tensor=name)
        return self.placements

    def loaded_numel(self) -> dict[str, int]:
        """Module -> elements its loaders copy from the checkpoint on this worker."""
        out: dict[str, int] = {}
        for placement in self.placements.values():
            out[placement.module_name] = out.get(placement.module_name, 0) + placement.box.numel
        return out


def _storage_id(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _geometry(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


class _Recorder(TorchDispatchMode):
    """Records every `copy_` as geometry and performs none (all tensors are on meta)."""

    def __init__(self, params: Mapping[int, str], sources: Mapping[int, str]):
        super().__init__()
        self.params, self.sources = params, sources
        self.writes: list[Write] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if (param := self.params.get(_storage_id(dst))) is not None:
                source = self.sources.get(_storage_id(src))
                dtypes = (src.dtype, dst.dtype)
                self.writes.append(Write(param, _geometry(dst), source, _geometry(src), dtypes))
            return dst
        return func(*args, **(kwargs or {}))


class _MetaWeights(DeviceContext):
    """The meta device for floating-point tensors (weights); tensors made with an integer dtype
    on the host: they are index tables (an expert map) that vLLM's loaders read values from."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            dtype = kwargs.get("dtype")
            kwargs["device"] = (
                "cpu" if dtype is not None and not dtype.is_floating_point else "meta"
            )
        return func(*args, **kwargs)


def meta_twin(model: torch.nn.Module, vllm_config: Any) -> torch.nn.Module:
    """A second instance of the served model's class on the meta device, built with a copy of
    its config (layers register themselves in the compilation config; the live one keeps its
    registry), its expert maps the served model's (checked).

    Raises:
        FormatError: the twin's experts would not sit where the served model holds them.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = copy.copy(vllm_config)
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}
    compilation.static_all_moe_layers = []
    config.compilation_config = compilation
    dtype = vllm_config.model_config.dtype
    with set_current_vllm_config(config), _MetaWeights("meta"), set_default_torch_dtype(dtype):
        twin = initialize_model(vllm_config=config, model_class=type(model))
    for name, module in twin.named_modules():
        if (manager := getattr(module, "expert_map_manager", None)) is not None:
            served = model.get_submodule(name).expert_map_manager.expert_map
            if not _same_map(served, manager.expert_map):
                raise FormatError(
                    "the served model's experts sit elsewhere than its config places them "
                    "(a rebalanced expert map: --enable-eplb?)",
                    tensor=name,
                )
    return twin


def _same_map(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.cpu(), b.cpu())


def record_writes(
    twin: torch.nn.Module, shapes: Shapes, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[Write], dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """Every weight-loader copy `twin.load_weights` makes for checkpoint tensors of `shapes`
    (handed over one at a time), each parameter's loader shape, the tensors whose loader
    raised (`name: error`), and the experts another worker holds (`name: parameter` that
    declined them, under expert parallelism)."""
    params: dict[int, str] = {}
    param_shapes = {}
    for name, param in twin.named_parameters(remove_duplicate=False):
        params.setdefault(_storage_id(param), name)  # a tied head is the embedding's parameter
        param_shapes.setdefault(name, tuple(param.shape))
    checkpoint = {n: torch.empty(tuple(s), dtype=dtype, device="meta") for n, s in shapes.items()}
    sources = {_storage_id(t): n for n, t in checkpoint.items()}
    recorder = _Recorder(params, sources)
    refused: dict[str, str] = {}
    declines: list[str] = []  # the parameters that declined the tensor being loaded
    _note_declines(twin, declines)
    elsewhere = {}
    with torch.no_grad():
        for name, tensor in checkpoint.items():
            declines.clear()
            try:
                with recorder:
                    twin.load_weights(iter([(name, tensor)]))
            except Exception as exc:  # the loader's own check, e.g. a shape that does not fit
                refused[name] = f"vLLM's loader refuses it: {type(exc).__name__}: {exc}"
            if declines:
                elsewhere[name] = declines[0]
    return recorder.writes, param_shapes, refused, elsewhere


def _note_declines(twin: torch.nn.Module, declines: list[str]) -> None:
    """Have each expert parameter's loader append its name to `declines` when it declines an
    expert because another worker holds it (vLLM's expert map; the twin is ours to change)."""
    for module_name, module in twin.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or manager.expert_map is None:
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if loader := getattr(param, "weight_loader", None):
                name = f"{module_name}.{param_name}"
                param.weight_loader = _declining(loader, manager, name, declines)


def _declining(loader: Callable, manager: Any, name: str, declines: list[str]) -> Callable:
    @functools.wraps(loader)
    def load(*args: Any, **kwargs: Any) -> Any:
        done = loader(*args, **kwargs)
        if done is False and not manager.is_local_expert(kwargs["expert_id"]):
            declines.append(name)
        return done

    return load


def derive_layout(
    model: torch.nn.Module,
    vllm_config: Any,
    shapes: Shapes,
    *,
    twin: torch.nn.Module | None = None,
) -> Layout:
    """The layout of checkpoint tensors of `shapes` in `model` (see the module docstring)."""
    return layout_from_writes(*record_writes(twin or meta_twin(model, vllm_config), shapes), shapes)


def layout_from_writes(
    writes: list[Write],
    param_shapes: Mapping[str, tuple[int, ...]],
    refused: Mapping[str, str],
    elsewhere: Mapping[str, str],
    shapes: Shapes,
) -> Layout:
    """Placements and reload groups from recorded loader copies (pure geometry); a tensor
    `elsewhere` names (another worker's expert) is placed as an empty box of the parameter
    that declined it, outside the reload groups."""
    layout = Layout(param_shapes=dict(param_shapes), problems=dict(refused))
    by_source: dict[str, list[Write]] = {}
    for write in writes:
        if write.source is None:
            module = write.param.rpartition(".")[0]
            layout.problems.setdefault(
                f"(a tensor loaded into {write.param})",
                f"vLLM's loader for {module} transforms the checkpoint's values",
            )
            continue
        by_source.setdefault(write.source, []).append(write)
    for name, shape in shapes.items():
        found = by_source.get(name, [])
        for write in found:
            module = write.param.rpartition(".")[0]
            members = layout.groups.setdefault(module, [])
            if name not in members:
                members.append(name)
        if name in layout.problems:
            continue
        if not found and name in elsewhere:
            param = elsewhere[name]
            module = param.rpartition(".")[0]
            layout.placements[name] = Placement(name, param, module, Box(shape, (0, 0)), 0)
            continue
        if not found:
            layout.problems[name] = "the served model does not load it"
            continue
        try:
            pieces = [_placement(name, tuple(shape), write) for write in found]
            layout.placements[name] = _merged(name, pieces)
        except FormatError as exc:
            layout.problems[name] = str(exc)
    return layout


def _merged(name: str, pieces: list[Placement]) -> Placement:
    """One placement from the pieces a loader copies a tensor in (Phi-3's fused qkv goes in
    as three shards): consecutive row ranges of the tensor into consecutive elements of one
    parameter."""
    if len(pieces) == 1:
        return pieces[0]
    pieces = sorted(pieces, key=lambda p: p.box.rows)
    first, box = pieces[0], pieces[0].box
    for before, after in pairwise(pieces):
        if (
            after.param_name != first.param_name
            or before.box.cols is not None
            or after.box.cols is not None
            or after.box.rows[0] != before.box.rows[1]
            or after.offset != before.offset + before.box.numel
        ):
            params = sorted({p.param_name for p in pieces})
            raise FormatError(
                f"vLLM's loader copies it in {len(pieces)} pieces that are not one run of {params}"
            )
    rows = (box.rows[0], pieces[-1].box.rows[1])
    return Placement(name, first.param_name, first.module_name, Box(box.shape, rows), first.offset)


def _placement(name: str, shape: tuple[int, ...], write: Write) -> Placement:
    src_dtype, dst_dtype = write.dtypes
    if src_dtype != dst_dtype:
        raise FormatError(f"vLLM casts it to {dst_dtype} in {write.param}")
    box = _box(shape, *write.src)
    offset, dst_shape, dst_stride = write.dst
    if math.prod(dst_shape) != box.numel:
        raise FormatError(f"shape {shape} does not fit {dst_shape} of {write.param}")
    if dst_stride != _contiguous(dst_shape):
        raise FormatError(
            f"vLLM writes it as a strided view {dst_shape} / {dst_stride} of {write.param}, "
            f"not as a contiguous run of {box.numel} elements"
        )
    return Placement(name, write.param, write.param.rpartition(".")[0], box, offset)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _box(
    shape: tuple[int, ...], offset: int, view: tuple[int, ...], stride: tuple[int, ...]
) -> Box:
    """The box of a checkpoint tensor of `shape` a loader's source view reads (rows, and
    columns of a 2-D tensor); anything else (a transpose, a reshape) is refused."""
    if not shape:
        if view or offset:
            raise FormatError("vLLM reads a scalar as a tensor")
        return Box.whole(shape)
    full = _contiguous(shape)
    if len(view) != len(shape) or any(
        size > 1 and step != expected
        for size, step, expected in zip(view, stride, full, strict=True)
    ):
        if math.prod(view) == math.prod(shape) and offset == 0 and stride == _contiguous(view):
            return Box.whole(shape)  # the whole tensor, reshaped (a view, same elements)
        raise FormatError(f"vLLM reads it as a strided view {view} / {stride} (transposed?)")
    starts, rest = [], offset
    for step in full:
        starts.append(rest // step)
        rest %= step
    rows = (starts[0], starts[0] + view[0])
    inner = [(s, s + v) for s, v, n in zip(starts[1:], view[1:], shape[1:], strict=True)]
    if len(shape) == 2 and inner[0] != (0, shape[1]):
        return Box(shape, rows, inner[0])
    if any(span != (0, n) for span, n in zip(inner, shape[1:], strict=True)):
        raise FormatError(f"vLLM reads a block {view} at offset {offset}; only rows or columns")
    return Box(shape, rows)


def with_owners(layout: Layout, model: torch.nn.Module, rank: int, size: int) -> Layout:
    """Mark which worker of `size` counts each element in the full-state digest (`Box.owner`).

    A box every worker holds whole (norms, a router) is owned by rank 0; an expert under expert
    parallelism by the one worker holding it (the others hold an empty box); a slice by the
    worker holding it, except the key/value heads of a fused q/k/v layer replicated over workers
    (`num_kv_head_replicas`, when TP exceeds the KV heads), owned by the first of each group.
    The engine checks that the owned boxes tile every tensor exactly once (`check_cover`).
    """
    if size == 1:
        return layout
    placements = {}
    for name, p in layout.placements.items():
        module = model.get_submodule(p.module_name)
        if getattr(module, "expert_map_manager", None) is not None and module.use_ep:
            owner = p.box.numel > 0
        elif p.box.is_whole:
            owner = rank == 0
        else:
            replicas = getattr(module, "num_kv_head_replicas", 1)
            owner = replicas == 1 or p.offset == 0 or rank % replicas == 0  # q sits first
        placements[name] = replace(p, box=replace(p.box, owner=owner))
    return replace(layout, placements=placements)


class LayoutOf:
    """`derive_layout` for one served model: the twin built once, each set of shapes derived
    once (a worker sees one model shape; a new one replaces it). Thread-safe.

    `tp`: this worker's tensor-parallel rank and size (boxes then say which worker owns what).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, tp: tuple[int, int] = (0, 1)):
        self.model, self.vllm_config, self.tp = model, vllm_config, tp
        self._twin: torch.nn.Module | None = None
        self._cached: tuple[tuple, Layout] | None = None
        self._lock = threading.Lock()

    def __call__(self, shapes: Shapes) -> Layout:
        key = tuple(sorted((n, tuple(s)) for n, s in shapes.items()))
        with self._lock:
            if self._cached is None or self._cached[0] != key:
                if self._twin is None:
                    self._twin = meta_twin(self.model, self.vllm_config)
                layout = derive_layout(self.model, None, shapes, twin=self._twin)
                self._cached = (key, with_owners(layout, self.model, *self.tp))
            return self._cached[1]
