"""Reading a virtual anchor's tensors from the checkpoint its source names.

Only `*.safetensors` files are read, one tensor (or one slice of it) at a time, and every
name and shape is checked against what the reader expects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.wire.source import ModelSource

__all__ = ["source_differences", "source_tensors", "tensor_files"]

_MAX_FILES = 4096


def tensor_files(source: ModelSource) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (every file's header read once)."""
    found: dict[str, Path] = {}
    files = sorted(p for p in source.folder.glob("*.safetensors") if p.is_file())
    if not files or len(files) > _MAX_FILES:
        raise FormatError(f"the model source {source} holds {len(files)} safetensors files")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found.setdefault(name, path)
        except Exception as exc:  # safetensors' own error type is not exported
            raise FormatError(f"unreadable checkpoint file {path.name}: {exc}") from None
    return found


def source_tensors(
    source: ModelSource,
    shapes: Mapping[str, tuple[int, ...]],
    boxes: Mapping[str, Box] | None = None,
    files: Mapping[str, Path] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, bf16 tensor) for every name of `shapes` (or its box), one at a time; a name
    missing from the checkpoint or of another shape is a `FormatError`."""
    files = tensor_files(source) if files is None else files
    missing = sorted(set(shapes) - set(files))
    if missing:
        raise FormatError(f"the model source {source} lacks tensors {missing[:5]}")
    for name, shape in shapes.items():
        with safe_open(str(files[name]), framework="pt") as f:
            piece = f.get_slice(name)
            if tuple(piece.get_shape()) != tuple(shape):
                raise FormatError(
                    f"shape {tuple(piece.get_shape())} in the model source, {shape} expected",
                    tensor=name,
                )
            box = None if boxes is None else boxes[name]
            if box is None or box == Box.whole(tuple(shape), owner=box.owner):
                tensor = f.get_tensor(name)
            elif box.cols is None:
                tensor = piece[box.rows[0] : box.rows[1]]
            else:
                tensor = piece[box.rows[0] : box.rows[1], box.cols[0] : box.cols[1]]
        yield name, tensor.to(torch.bfloat16).contiguous()


def source_differences(source: ModelSource, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose bf16 bytes differ from the checkpoint's (or that it lacks), checked one
    tensor at a time; empty means version 1 can be a virtual anchor of this source."""
    try:
        files = tensor_files(source)
    except FormatError as exc:
        return [str(exc)]
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if n in files}
    differ = sorted(set(tensors) - set(files))
    try:
        for name, loaded in source_tensors(source, shapes, files=files):
            if not torch.equal(loaded.view(torch.int16), tensors[name].view(torch.int16)):
                differ.append(name)
    except FormatError as exc:
        differ.append(str(exc))
    return differ
