"""Encoding and decoding anchor and delta files (the tensor side of the codec).

Every input is validated (header bounds, metadata, key set, dtypes, shapes, index ranges) before a
caller's state can be touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import safetensors.torch
import torch

from deltasync.codec import ans, coo, ctx, packed  # noqa: F401  (each registers its codec)
from deltasync.codec.anchors import read_anchor
from deltasync.codec.registry import TensorToDecode, codec_of
from deltasync.codec.virtual import source_tensors
from deltasync.defaults import ENCODING
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box, Boxes
from deltasync.kernels.changes import WORKERS, Diff, TensorChange, bits
from deltasync.kernels.state_hash import state_sums
from deltasync.wire.digests import StateDigest, tensor_digest, total
from deltasync.wire.header import TensorInfo
from deltasync.wire.metadata import (
    ENCODINGS,
    FileMetadata,
    ParsedFile,
    ParsedParts,
    PartInfo,
    TensorEntry,
    validate_run_id,
)
from deltasync.wire.source import ModelSource
from deltasync.wire.stored import StoredFile

__all__ = [
    "DecodedFile",
    "Gathering",
    "anchor_metadata",
    "decode",
    "encode_anchor",
    "encode_delta",
    "encode_virtual_anchor",
]


@runtime_checkable
class Gathering(Protocol):
    """A delta's base that gives its values only at given flat indices (a device sink's
    parameters, selected where they live), so that decoding never copies a whole tensor of it."""

    def __contains__(self, name: object) -> bool: ...

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor held under `name`."""
        ...

    def gather(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """A fresh CPU bf16 tensor of the values at flat int64 `indices` of tensor `name`."""
        ...

    def held(self, name: str) -> tuple[torch.Tensor, list[TensorChange]]:
        """The tensor where it lives (not copied, not to be written) and the changes of
        earlier staged deltas not yet in it, in order (what a `ctx` delta's classes see)."""
        ...


@dataclass(frozen=True)
class DecodedFile:
    """A validated file: full `tensors` for an anchor (with the xxh3 `digests` of the whole
    ones, computed as their bytes were read), per-tensor `changes` for a delta."""

    meta: FileMetadata
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    changes: dict[str, TensorChange] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


def encode_anchor(
    tensors: Mapping[str, torch.Tensor],
    *,
    run_id: str,
    version: int,
    digests: Mapping[str, str] | None = None,
    state_digest: StateDigest | None = None,
    part: PartInfo | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> bytes:
    """A full bf16 checkpoint that transformers and vLLM load as is (metadata format=pt).

    `digests` (per-tensor xxh3) and `state_digest` are computed when not given. With `part`,
    the file is one part of a sharded anchor: `tensors` are the part's rows of each tensor,
    `shapes` the full shapes, and `state_digest` (required) the part's share of the digest.
    """
    metadata = anchor_metadata(
        tensors,
        run_id=run_id,
        version=version,
        digests=digests,
        state_digest=state_digest,
        part=part,
        shapes=shapes,
    )
    return safetensors.torch.save(dict(tensors), metadata=metadata)


def anchor_metadata(
    tensors: Mapping[str, torch.Tensor],
    *,
    run_id: str,
    version: int,
    digests: Mapping[str, str] | None = None,
    state_digest: StateDigest | None = None,
    part: PartInfo | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, str]:
    """The `__metadata__` of `encode_anchor`'s file, for a writer that streams the tensors
    to a file itself (`tools.export.weights.write_safetensors`)."""
    validate_run_id(run_id)
    if version < 1:
        raise FormatError(f"versions count from 1, got {version}")
    _check_savable(tensors)
    if part is not None:
        if shapes is None or state_digest is None:
            raise ValueError("an anchor part needs the full shapes and its state digest")
        for name, t in tensors.items():
            start, stop = part.rows[name]
            if tuple(t.shape) != (stop - start, *shapes[name][1:]):
                raise FormatError(
                    f"rows {start}:{stop} of {shapes[name]} but {t.shape}", tensor=name
                )
        entries = {n: TensorEntry(tuple(shapes[n]), None, t.numel()) for n, t in tensors.items()}
    else:
        digests = digests or {n: tensor_digest(t) for n, t in tensors.items()}
        state_digest = state_digest or total(state_sums(tensors))
        entries = {
            n: TensorEntry(tuple(t.shape), digests[n], t.numel()) for n, t in tensors.items()
        }
    meta = FileMetadata(
        run_id, version, None, "anchor", "full", entries, state_digest=state_digest, part=part
    )
    return meta.to_strings()


def _check_savable(tensors: Mapping[str, torch.Tensor]) -> None:
    """What safetensors' `save` checks, as `FormatError`s naming the tensor and before anything
    is encoded: dense, contiguous bf16 CPU tensors, no two sharing memory (a tied alias is one
    tensor under one name; `snapshot.named_tensors` drops the others)."""
    owners: dict[int, str] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise FormatError(f"anchors hold dense tensors, found {type(t).__name__}", tensor=name)
        if t.dtype != torch.bfloat16 or t.device.type != "cpu":
            raise FormatError(
                f"anchors hold bf16 CPU tensors, found {t.dtype} on {t.device}", tensor=name
            )
        if not t.is_contiguous():
            raise FormatError("anchors hold contiguous tensors, found a strided view", tensor=name)
        if t.numel():
            storage = t.untyped_storage().data_ptr()
            if storage in owners:
                raise FormatError(f"shares its memory with {owners[storage]!r}", tensor=name)
            owners[storage] = name


def encode_virtual_anchor(
    tensors: Mapping[str, torch.Tensor],
    source: ModelSource,
    *,
    run_id: str,
    version: int,
    digests: Mapping[str, str] | None = None,
    state_digest: StateDigest | None = None,
) -> bytes:
    """An anchor that names `source` (whose bf16 view equals `tensors`, as the caller checked)
    instead of carrying the weights: a safetensors header of metadata, no tensors. Readers load
    the tensors from the source and verify them against these digests."""
    validate_run_id(run_id)
    if version < 1:
        raise FormatError(f"versions count from 1, got {version}")
    digests = digests or {n: tensor_digest(t) for n, t in tensors.items()}
    state_digest = state_digest or total(state_sums(tensors))
    entries = {n: TensorEntry(tuple(t.shape), digests[n], t.numel()) for n, t in tensors.items()}
    meta = FileMetadata(
        run_id,
        version,
        None,
        "anchor",
        "virtual",
        entries,
        state_digest=state_digest,
        source=source,
    )
    return safetensors.torch.save({}, metadata=meta.to_strings())


def encode_delta(
    diff: Diff,
    *,
    run_id: str,
    version: int,
    base_version: int,
    state_digest: StateDigest,
    encoding: str = ENCODING,
    part: PartInfo | None = None,
    base: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """A sparse delta from `base_version` to `version`, with post-update digests of all tensors
    and of the whole state (`state_digest`: the base's moved by `state_hash.apply_changes`).

    With `part`, one part of a sharded version: `diff` holds the part's changes at global flat
    indices inside its rows, full shapes, no per-tensor digests, and `state_digest` is the
    part's share of the version's digest. `ctx` codes against the base: `base` holds every
    tensor at `base_version` (the part's rows of it)."""
    validate_run_id(run_id)
    if encoding not in ENCODINGS:
        raise FormatError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    codec = codec_of(encoding)
    if base_version != version - 1:  # readers refuse anything else (bucket_layout.md)
        raise FormatError(f"base_version {base_version} must be version - 1 ({version - 1})")
    entries = {
        n: TensorEntry(shape, None if part else diff.digests[n], _changed_count(diff, n))
        for n, shape in diff.shapes.items()
    }
    if part is not None:
        for name, change in diff.changes.items():
            lo, hi = part.flat_range(name, diff.shapes[name])
            first, last = int(change.indices[0]), int(change.indices[-1])
            if not lo <= first <= last < hi:
                raise FormatError(f"changes outside the part's elements {lo}:{hi}", tensor=name)
    meta = FileMetadata(
        run_id,
        version,
        base_version,
        "delta",
        encoding,
        entries,
        state_digest=state_digest,  # type: ignore[arg-type]
        part=part,
    )
    if codec.needs_base and base is None:
        raise ValueError(f"the {encoding} encoding codes against the base: pass `base`")
    rows = None if part is None else {n: part.rows[n] for n in diff.changes}
    payload = codec.encode(diff.changes, diff.shapes, base, rows)
    return safetensors.torch.save(payload, metadata=meta.to_strings())


def _changed_count(diff: Diff, name: str) -> int:
    change = diff.changes.get(name)
    return 0 if change is None else change.indices.numel()


def decode(
    file: bytes | ParsedFile | StoredFile | ParsedParts,
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    path: str | None = None,
    offsets: Mapping[str, int] | None = None,
    boxes: Boxes | None = None,
    consume: Callable[[str, TensorChange], None] | None = None,
) -> DecodedFile:
    """Validate and decode a file; deltas need `base`, the reader's tensors at the base version.

    Pass a `ParsedFile` when the header was parsed already (a TRL v1 delta must be, and
    normalised against the reader: `ParsedFile.normalised`). The parts of a sharded version
    (`ParsedParts`) decode into one file, as if it had been written whole. With `offsets`, a
    delta decodes against boxes of rows: `base[name]` holds the tensor from flat index
    `offsets[name]` on, and the changes' indices are relative to it (a rank replaying its own
    part). With `boxes`, the reader holds one box of each tensor (a tensor-parallel worker):
    an anchor yields only the boxes (reading only their bytes), a delta only the changes inside
    them, at the boxes' flat indices, against `base` holding the boxes. A `base` that gathers
    (`Gathering`) is read only at the changed indices. With `consume`, a delta's changes are
    handed over tensor by tensor as each is decoded (and not kept: `changes` comes back
    empty), so that a reader writing them into tensors of its own holds one at a time. Raises
    `FormatError` for anything malformed; never mutates `base`.
    """
    if isinstance(file, ParsedParts):
        return _decode_parts(file, base, boxes)
    parsed = (
        file if isinstance(file, ParsedFile | StoredFile) else ParsedFile.parse(file, path=path)
    )
    header, meta, path = parsed.header, parsed.meta, parsed.path
    try:
        if meta.kind == "anchor":
            _check_anchor_keys(meta, header.tensors)
            if meta.source is not None:  # a virtual anchor: the tensors come from its source
                shapes = {n: e.shape for n, e in meta.tensors.items()}
                return DecodedFile(meta, tensors=dict(source_tensors(meta.source, shapes, boxes)))
            tensors, digests = read_anchor(parsed, boxes=boxes)
            return DecodedFile(meta, tensors=tensors, digests=digests)
        if isinstance(parsed, StoredFile):
            raise FormatError("a delta is decoded from its bytes, read whole", path=path)
        if base is None:
            raise FormatError("decoding a delta needs the base tensors", path=path)
        if meta.declared is not None:
            raise FormatError(
                "a TRL v1 delta decodes only against a reader's state (ParsedFile.normalised)",
                path=path,
            )
        names = _check_delta_keys(meta, header.tensors)
        tensors = _arrays(parsed)

        def one(name: str) -> TensorChange | None:
            change = _decode_one(meta, name, tensors, base, offsets, boxes)
            if consume is None:
                return change
            consume(name, change)
            return None

        with ThreadPoolExecutor(WORKERS) as pool:  # zstd and the compiled decoders release the GIL
            decoded = list(pool.map(one, names))
        if consume is not None:
            return DecodedFile(meta)
        return DecodedFile(meta, changes=dict(zip(names, decoded, strict=True)))  # type: ignore[arg-type]
    except FormatError as exc:
        if exc.path is None and path is not None:
            raise FormatError(str(exc), path=path, tensor=exc.tensor) from None
        raise


def _decode_parts(
    parts: ParsedParts, base: Mapping[str, torch.Tensor] | None, boxes: Boxes | None
) -> DecodedFile:
    """Each part decoded on its own (delta indices are global, so against the full base), its
    changes checked to lie in its rows, then joined in part order: rows concatenated for an
    anchor, index lists for a delta (the parts' rows ascend, so the indices stay ascending;
    so do a box's own indices, which keep row-major order)."""
    meta = parts.meta
    if meta.kind == "anchor":
        return DecodedFile(meta, tensors=_read_anchor_parts(parts, boxes))
    decoded = [decode(p, base=base, boxes=boxes) for p in parts.parts]
    per_tensor: dict[str, list[TensorChange]] = {}
    for part, found in zip(parts.parts, decoded, strict=True):
        info = part.meta.part
        assert info is not None
        for name, change in found.changes.items():
            lo, hi = info.flat_range(name, meta.tensors[name].shape)
            if not change.indices.numel():
                continue
            ends = change.indices[[0, -1]]
            first, last = (boxes[name].globalize(ends) if boxes is not None else ends).tolist()
            if not (lo <= first and last < hi):
                raise FormatError(
                    f"part {info.index} changes elements outside its rows ({lo}:{hi})",
                    path=part.path,
                    tensor=name,
                )
            per_tensor.setdefault(name, []).append(change)
    changes = {
        name: TensorChange(*(torch.cat([getattr(c, f) for c in found]) for f in _CHANGE_FIELDS))
        if len(found) > 1
        else found[0]
        for name, found in per_tensor.items()
    }
    return DecodedFile(meta, changes=changes)


_CHANGE_FIELDS = ("indices", "values", "previous")


def _read_anchor_parts(parts: ParsedParts, boxes: Boxes | None) -> dict[str, torch.Tensor]:
    """Each tensor (or box) allocated once, each part's rows read straight into their place."""
    shapes = {n: e.shape for n, e in parts.meta.tensors.items()}
    held = boxes if boxes is not None else {n: Box.whole(s) for n, s in shapes.items()}
    unknown = sorted(set(shapes) - set(held))
    if unknown:
        raise FormatError("unknown tensor name (not in the reader's model)", tensor=unknown[0])
    tensors = {n: torch.empty(held[n].local_shape, dtype=torch.bfloat16) for n in shapes}
    for part in parts.parts:
        assert part.meta.part is not None
        _check_anchor_keys(part.meta, part.header.tensors)
        clipped, into = {}, {}
        for name, (start, stop) in part.meta.part.rows.items():
            box = held[name].clip(start, stop)
            first = box.rows[0] + start - held[name].rows[0]  # in the held box's own rows
            clipped[name] = box
            into[name] = tensors[name][first : first + box.rows[1] - box.rows[0]]
        try:
            read_anchor(part, boxes=clipped, into=into)
        except FormatError as exc:
            raise FormatError(str(exc), path=part.path, tensor=exc.tensor) from None
    return tensors


_TORCH_DTYPES = {"U8": torch.uint8, "I32": torch.int32, "BF16": torch.bfloat16}


def _arrays(parsed: ParsedFile) -> dict[str, torch.Tensor]:
    """A delta's arrays as views of its bytes, not copies: the header was checked (its offsets
    tile the data section, its dtypes are the encoding's), and the decoders only read them."""
    header, out = parsed.header, {}
    with warnings.catch_warnings():  # a view of `bytes` is not writable; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        for name, info in header.tensors.items():
            dtype = _TORCH_DTYPES[info.dtype]
            if not info.numel:
                out[name] = torch.empty(info.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(
                parsed.data, dtype=dtype, count=info.numel, offset=header.data_offset + info.start
            )
            out[name] = flat.reshape(info.shape)
    return out


def _check_anchor_keys(meta: FileMetadata, infos: dict[str, TensorInfo]) -> None:
    if meta.source is not None:
        if infos:
            raise FormatError(f"a virtual anchor holds no tensors, found {len(infos)}")
        return
    for name, info in infos.items():
        if info.dtype != "BF16":
            raise FormatError(f"anchor tensors must be BF16, found {info.dtype}", tensor=name)
    if set(infos) != set(meta.tensors):
        raise FormatError(
            f"anchor tensors {sorted(set(infos) ^ set(meta.tensors))[:5]} disagree with metadata"
        )
    for name, info in infos.items():
        shape = meta.tensors[name].shape
        if meta.part is not None:  # a part holds its rows of each tensor
            start, stop = meta.part.rows[name]
            shape = (stop - start, *shape[1:])
        if info.shape != shape:
            raise FormatError(f"shape {info.shape} disagrees with metadata {shape}", tensor=name)


def _check_delta_keys(meta: FileMetadata, infos: dict[str, TensorInfo]) -> list[str]:
    """The changed tensor names, once key set, dtypes and 1-D shapes match the encoding."""
    wire = codec_of(meta.encoding).wire
    suffixes = wire.suffixes
    first = suffixes[0]
    names = [k[: -len(first)] for k in infos if k.endswith(first)]
    expected = {n + suffix for n in names for suffix in suffixes}
    if set(infos) != expected:
        raise FormatError(
            f"unexpected keys for encoding {meta.encoding}: {sorted(set(infos) ^ expected)[:5]}"
        )
    declared = {n for n, e in meta.tensors.items() if e.changed}
    if set(names) != declared:
        raise FormatError(
            f"changed tensors {sorted(set(names) ^ declared)[:5]} disagree with metadata"
        )
    for name in names:
        for suffix, dtype in zip(suffixes, wire.dtypes, strict=True):
            info = infos[name + suffix]
            if info.dtype != dtype or len(info.shape) != 1:
                raise FormatError(
                    f"{suffix[1:]} must be 1-D {dtype}, found {info.dtype} {list(info.shape)}",
                    tensor=name,
                )
    return names


def _decode_one(
    meta: FileMetadata,
    name: str,
    tensors: dict[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    offsets: Mapping[str, int] | None = None,
    boxes: Boxes | None = None,
) -> TensorChange:
    if name not in base:
        raise FormatError("unknown tensor name (not in the reader's model)", tensor=name)
    gathering = base if isinstance(base, Gathering) else None
    target = base[name] if gathering is None else _zeros(gathering.shape_of(name))
    held = tuple(target.shape)
    entry = meta.tensors[name]
    offset = 0 if offsets is None else offsets[name]
    box = None if boxes is None else boxes[name]
    if box is not None:
        if entry.shape != box.shape or held != box.local_shape:
            raise FormatError(
                f"shape {entry.shape} differs from the reader's {box.shape} (box "
                f"{box.local_shape}, held {held})",
                tensor=name,
            )
    elif offsets is None and entry.shape != held:
        raise FormatError(f"shape {entry.shape} differs from the reader's {held}", tensor=name)
    codec = codec_of(meta.encoding)
    one = TensorToDecode(
        name,
        tuple(tensors[name + suffix] for suffix in codec.wire.suffixes),
        entry.changed,
        entry.shape,
        target,
        rows=None if meta.part is None else meta.part.rows[name],
        offset=offset,
        box=box,
        held=gathering if codec.device_decode else None,
    )
    try:
        change = codec.decode(one)
    except FormatError as exc:
        raise FormatError(str(exc), tensor=name) from None
    if box is None and change.indices.numel() != entry.changed:
        raise FormatError(
            f"{change.indices.numel()} changes, metadata says {entry.changed}", tensor=name
        )
    if gathering is None:
        return change
    return _rebased(change, gathering.gather(name, change.indices), codec.steps_from_base)


def _zeros(shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor of zeros of `shape` that takes no memory (every element is one)."""
    return torch.zeros((), dtype=torch.bfloat16).expand(shape)


def _rebased(change: TensorChange, previous: torch.Tensor, steps: bool) -> TensorChange:
    """A change decoded against zeros, given the base's values at its indices.

    A codec codes each value either as a step from the base's value modulo 2**16 (`steps`:
    against zeros it decodes to the steps, and every check it makes is on the steps and
    indices, not on the base) or as itself; so decoding against zeros and then adding the
    base's values at the changed indices gives what decoding against the whole base gives,
    reading the base only there.
    """
    values = change.values
    if steps:
        values = torch.from_numpy(bits(previous) + bits(change.values)).view(torch.bfloat16)
    return TensorChange(change.indices, values, previous)
