"""Reading a virtual anchor's tensors from the checkpoint its source names.

Only `*.safetensors` files are read, one tensor (or one slice of it) at a time, and every
name and shape is checked against what the reader expects. A bucket writer chooses the source,
so a replica reads one only where its `SourcePolicy` allows: its own model's folder or Hub repo.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.wire.source import ModelSource

__all__ = [
    "SourcePolicy",
    "source_differences",
    "source_tensors",
    "tensor_files",
]

_MAX_FILES = 4096
# The same message whatever the path: a refusal never tells what exists outside the roots.
_OUTSIDE = (
    "the virtual anchor's source is outside the folders this replica may read (its --model "
    "folder, the Hub cache of its repo, --source-root)"
)


@dataclass(frozen=True)
class SourcePolicy:
    """Where a replica may load a virtual anchor from.

    A folder source must resolve, symlinks followed, under one of `roots`, and so must each of
    its safetensors files; a hub source must name one of `repos`, and its download is refused
    beforehand when larger than a checkpoint of the anchor's shapes can be (4 B an element).
    """

    roots: tuple[Path, ...] = ()
    repos: frozenset[str] = frozenset()

    @classmethod
    def for_model(cls, model: str, more: Iterable[str | Path] = ()) -> SourcePolicy:
        """What a replica serving `model` (its `--model`: a folder or a Hub id) may read: that
        folder (inside the Hub cache: its repo's cache, whose blobs its files link to), or that
        repo's cache, and the `more` folders."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        folder = Path(model)
        if folder.is_dir():
            found, repos = folder.resolve(), frozenset()
            repo_dir = found.parents[1] if len(found.parents) > 1 else found
            in_cache = found.parent.name == "snapshots" and repo_dir.name.startswith("models--")
            roots = [repo_dir if in_cache else found]
        else:
            cache = Path(constants.HF_HUB_CACHE) / repo_folder_name(
                repo_id=model, repo_type="model"
            )
            roots, repos = [cache.resolve()], frozenset({model})
        return cls((*roots, *(Path(p).resolve() for p in more)), repos)

    def check(self, source: ModelSource, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise `FormatError` unless `source` may be read; downloads a hub source (bounded)."""
        if source.kind == "hub":
            if source.location not in self.repos:
                raise FormatError(
                    f"the virtual anchor's source {source.location} is not the repo this "
                    f"replica serves ({', '.join(sorted(self.repos)) or 'a local folder'})"
                )
            _check_download_size(source, 4 * sum(math.prod(s) for s in shapes.values()))
        elif not self._allowed(Path(source.location)):
            raise FormatError(_OUTSIDE)
        folder = source.folder
        if not all(self._allowed(p) for p in folder.glob("*.safetensors")):
            raise FormatError(_OUTSIDE)

    def _allowed(self, path: Path) -> bool:
        resolved = path.resolve()
        return any(resolved.is_relative_to(root) for root in self.roots)


def _check_download_size(source: ModelSource, limit: int) -> None:
    """Refuse a hub source whose safetensors files to download add up past `limit` (what the
    Hub lists for the commit; when it cannot be asked, the download itself decides)."""
    from huggingface_hub import snapshot_download

    try:
        listed = snapshot_download(
            source.location,
            revision=source.revision,
            allow_patterns=["*.safetensors"],
            dry_run=True,
        )
    except Exception:  # offline (a cached commit still loads), gated, unknown repo or commit
        return
    size = sum(f.file_size or 0 for f in listed if f.will_download)
    if size > limit + 64 * 2**20:  # headers and padding
        raise FormatError(
            f"the model source {source} would download {size} bytes, more than a checkpoint "
            f"of this model can hold ({limit})"
        )


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
