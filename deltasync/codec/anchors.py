"""Reading an anchor's tensors from its bytes in pieces, straight into where they go.

A reader never holds an anchor's bytes beside its tensors: each tensor (or the box of it a
tensor-parallel worker holds, `kernels.boxes`) is allocated once and filled from the file's
pieces as they arrive (`wire.stored`: at most a window of bytes in flight), and each whole
tensor's xxh3 is computed as its bytes pass. A file in memory (`ParsedFile`) is read the same
way from its buffer.

A reader holding boxes reads only their byte ranges: a box of rows is one range; a box of
columns needs the tensor's rows (a row-major file stores them whole), read in pieces of whole
rows so that each piece's columns are copied out at once. The whole-file digest cannot be
checked on a part of a file: the header still promises the manifest's full-state digest, and
the workers' combined digest of the values read checks every element.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from deltasync.defaults import READ_WINDOW_BYTES
from deltasync.errors import DigestMismatch, FormatError
from deltasync.kernels.boxes import Box, Boxes
from deltasync.wire.metadata import ParsedFile
from deltasync.wire.stored import ByteRange, StoredFile

__all__ = ["AnchorFile", "compare_anchor", "read_anchor"]

AnchorFile = ParsedFile | StoredFile


@dataclass
class _Target:
    """Where the bytes `[start, stop)` of the file go: into `dest` (flat bytes; for a box of
    columns, rows of `row_bytes` of which the bytes `cols` are kept), through `hasher`, and
    compared with `compare` (flat bytes). Once its last byte has passed, a tensor whose xxh3
    differs from `expected` raises `DigestMismatch`, one that differs from `compare`
    `FormatError`, both naming it."""

    name: str
    start: int
    stop: int
    dest: np.ndarray | None = None
    row_bytes: int = 0
    cols: tuple[int, int] | None = None
    hasher: xxhash.xxh3_128 | None = None
    expected: str | None = None
    compare: np.ndarray | None = None
    differs: bool = False
    path: str | None = None

    @property
    def byte_range(self) -> ByteRange:
        return ByteRange(self.start, self.stop, self.row_bytes if self.cols else 1)

    def take(self, at: int, data: np.ndarray) -> None:
        """`data`: the target's bytes from file offset `at` on."""
        local = at - self.start
        if self.cols is not None:  # whole rows (the pieces are aligned to them)
            assert self.dest is not None and local % self.row_bytes == 0
            rows = data.reshape(-1, self.row_bytes)[:, self.cols[0] : self.cols[1]]
            first = local // self.row_bytes
            self.dest.reshape(-1, self.cols[1] - self.cols[0])[first : first + len(rows)] = rows
            return
        if self.dest is not None:
            self.dest[local : local + data.size] = data
        if self.hasher is not None:
            self.hasher.update(data)
        if self.compare is not None:
            self.differs |= not np.array_equal(self.compare[local : local + data.size], data)
        if at + data.size == self.stop:
            self.finish()

    def finish(self) -> None:
        if self.expected is not None and self.hasher is not None:
            found = self.hasher.hexdigest()
            if found != self.expected:
                raise DigestMismatch(self.name, self.expected, found, path=self.path)
        if self.differs:
            raise FormatError(
                "its bytes differ from the state compared with", path=self.path, tensor=self.name
            )


def _flat_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _targets_of(
    file: AnchorFile,
    boxes: Boxes | None,
    into: Mapping[str, torch.Tensor] | None,
    tensors: dict[str, torch.Tensor],
) -> list[_Target]:
    """One target per tensor of the file: its box's bytes into a tensor of the box's shape
    (`into[name]` when given, else a new one, added to `tensors`)."""
    header = file.header
    targets = []
    for name, info in header.tensors.items():
        box = Box.whole(info.shape) if boxes is None else boxes.get(name)
        if box is None:
            raise FormatError("unknown tensor name (not in the reader's model)", tensor=name)
        if box.shape != info.shape:
            raise FormatError(
                f"shape {info.shape} differs from the reader's {box.shape}", tensor=name
            )
        dest = (
            into[name] if into is not None else torch.empty(box.local_shape, dtype=torch.bfloat16)
        )
        if tuple(dest.shape) != box.local_shape or not dest.is_contiguous():
            raise ValueError(f"{name}: a contiguous {box.local_shape} destination is needed")
        tensors[name] = dest
        row_bytes = 2 * box.row_numel
        start = header.data_offset + info.start + box.rows[0] * row_bytes
        if box.cols is None:
            target = _Target(name, start, start + box.numel * 2, _flat_bytes(dest), path=file.path)
            if box.is_whole:
                target.hasher = xxhash.xxh3_128()
        else:
            stop = start + (box.rows[1] - box.rows[0]) * row_bytes
            cols = (2 * box.cols[0], 2 * box.cols[1])
            target = _Target(name, start, stop, _flat_bytes(dest), row_bytes, cols, path=file.path)
        targets.append(target)
    return targets


def _pieces(
    file: AnchorFile, ranges: list[ByteRange] | None, window: int
) -> Iterator[tuple[int, np.ndarray]]:
    """The file's pieces: all of it (None; a stored file's size and digest checked at the end)
    or `ranges` only."""
    if isinstance(file, StoredFile):
        found = file.stream(window=window) if ranges is None else file.pieces(ranges, window=window)
        for at, data in found:
            yield at, np.frombuffer(data, np.uint8)
        return
    whole = np.frombuffer(file.data, np.uint8)
    for r in [ByteRange(0, whole.size)] if ranges is None else ranges:
        yield r.start, whole[r.start : r.stop]


def _feed(file: AnchorFile, targets: list[_Target], *, whole: bool, window: int) -> None:
    """Every target's bytes, piece by piece, in file order."""
    targets = sorted(targets, key=lambda t: t.start)
    ranges = None if whole else [t.byte_range for t in targets]
    first = 0
    for at, data in _pieces(file, ranges, window):
        end = at + data.size
        while first < len(targets) and targets[first].stop <= at:
            first += 1
        for target in targets[first:]:
            if target.start >= end:
                break
            lo, hi = max(at, target.start), min(end, target.stop)
            if hi > lo:
                target.take(lo, data[lo - at : hi - at])
    for target in targets:
        if target.start == target.stop:  # an empty tensor: no byte passes, its digest still must
            target.finish()


def read_anchor(
    file: AnchorFile,
    *,
    boxes: Boxes | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    window: int = READ_WINDOW_BYTES,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors (each reader's box of them, with `boxes`), read into new tensors or
    into `into` (contiguous tensors of the boxes' shapes), and the xxh3 of each whole tensor
    read. Without boxes every byte of a stored file is read and its size and digest checked;
    with boxes, only theirs. The header was checked (`codec.files`); raises `FormatError`."""
    tensors: dict[str, torch.Tensor] = {}
    targets = _targets_of(file, boxes, into, tensors)
    _feed(file, targets, whole=boxes is None, window=window)
    digests = {t.name: t.hasher.hexdigest() for t in targets if t.hasher is not None}
    return tensors, digests


def compare_anchor(
    file: AnchorFile,
    state: Mapping[str, torch.Tensor],
    *,
    rows: Mapping[str, tuple[int, int]] | None = None,
    window: int = READ_WINDOW_BYTES,
) -> None:
    """Check every byte of an anchor without holding it: each tensor against its digest in the
    header (where it has one) and against `state`'s bytes (a part: the `rows` it holds of
    each), the whole file against the manifest's size and digest (a stored file).

    Raises:
        DigestMismatch: a tensor's bytes differ from its digest (named).
        FormatError: they differ from `state` (named), or the file from the manifest.
    """
    targets = []
    meta, header = file.meta, file.header
    for name, info in header.tensors.items():
        if name not in state:
            raise FormatError("unknown tensor name (not in the state compared with)", tensor=name)
        held = state[name]
        if rows is not None:
            held = held[rows[name][0] : rows[name][1]]
        if tuple(held.shape) != info.shape:
            raise FormatError(f"shape {info.shape} differs from the state's", tensor=name)
        start = header.data_offset + info.start
        entry = meta.tensors.get(name)
        expected = entry.digest if entry is not None else None
        targets.append(
            _Target(
                name,
                start,
                start + info.nbytes,
                hasher=xxhash.xxh3_128() if expected else None,
                expected=expected,
                compare=_flat_bytes(held.contiguous()),
                path=file.path,
            )
        )
    _feed(file, targets, whole=True, window=window)
