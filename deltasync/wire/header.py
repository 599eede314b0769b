"""Bounded parsing of safetensors headers: validated before any tensor byte is touched."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

from deltasync.errors import FormatError
from deltasync.wire.fields import is_int

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "SafetensorsHeader",
    "TensorInfo",
    "header_budget",
    "header_length",
    "parse_header",
    "parse_header_bytes",
]

MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 1_000_000
# What one model tensor can take in a header: up to a few stored entries (a delta's arrays) with
# their names, shapes and offsets, plus its metadata (digest, counts); measured ~270 bytes with
# 46-character names, so 4 KiB leaves room for long names and every encoding.
HEADER_BYTES_PER_TENSOR = 4096
HEADER_BYTES_BASE = 64 * 1024
_DTYPE_SIZES = {  # bytes per element
    **dict.fromkeys(("BOOL", "U8", "I8"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The JSON header of a safetensors file, checked for consistency with the file size."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_offset: int


def header_budget(tensors: int | None) -> int:
    """The largest header a file of a model with `tensors` tensors can need (None: unknown,
    the global `MAX_HEADER_BYTES`): a reader that knows its model refuses a hostile header by
    its 8-byte length, before reading or parsing the JSON."""
    if tensors is None:
        return MAX_HEADER_BYTES
    return min(MAX_HEADER_BYTES, HEADER_BYTES_BASE + HEADER_BYTES_PER_TENSOR * tensors)


def header_length(prefix: bytes, *, path: str | None = None, limit: int = MAX_HEADER_BYTES) -> int:
    """The header size from the first 8 bytes, refusing sizes past `limit`."""
    if len(prefix) < 8:
        raise FormatError(f"truncated file: {len(prefix)} bytes, a header needs 8", path=path)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > limit:
        why = "" if limit == MAX_HEADER_BYTES else " (what this reader's model can need)"
        raise FormatError(f"header size {n} outside 2..{limit} bytes{why}", path=path)
    return n


def parse_header(
    read: Callable[[int, int], bytes],
    file_size: int | None,
    *,
    path: str | None = None,
    tensors: int | None = None,
) -> SafetensorsHeader:
    """Parse and validate a header using `read(start, end)`, e.g. byte-range reads from a store.

    Its size is bounded by `header_budget(tensors)` (`tensors`: the reader's model's tensor
    count, when it knows it); the offsets must tile the data section when `file_size` is given.
    The other checks are bucket_layout.md's "Reader checks".
    """
    n = header_length(read(0, 8), path=path, limit=header_budget(tensors))
    if file_size is not None and 8 + n > file_size:
        raise FormatError(f"truncated file: header of {n} bytes, file of {file_size}", path=path)
    raw = read(8, 8 + n)
    if len(raw) != n:
        raise FormatError(f"truncated header: expected {n} bytes, got {len(raw)}", path=path)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also too deep or a number too long to parse
        raise FormatError(f"header is not valid JSON: {exc}", path=path) from None
    if not isinstance(obj, dict):
        raise FormatError("header is not a JSON object", path=path)
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("__metadata__ must map strings to strings", path=path)
    if len(obj) > MAX_TENSORS:
        raise FormatError(f"{len(obj)} tensors, at most {MAX_TENSORS} allowed", path=path)
    tensors = {name: _tensor_info(name, info, path) for name, info in obj.items()}
    _check_layout(tensors, None if file_size is None else file_size - 8 - n, path)
    return SafetensorsHeader(metadata, tensors, 8 + n)


def parse_header_bytes(
    data: bytes, *, path: str | None = None, tensors: int | None = None
) -> SafetensorsHeader:
    """`parse_header` over a complete file held in memory."""
    view = memoryview(data)
    return parse_header(lambda a, b: bytes(view[a:b]), len(data), path=path, tensors=tensors)


def _tensor_info(name: str, info: object, path: str | None) -> TensorInfo:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(
            "tensor entry needs exactly dtype, shape, data_offsets", path=path, tensor=name
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPE_SIZES:
        raise FormatError(f"unknown dtype {dtype!r}", path=path, tensor=name)
    if not isinstance(shape, list) or not all(
        is_int(d, minimum=0, maximum=2**50 - 1) for d in shape
    ):
        raise FormatError(f"invalid shape {shape!r}", path=path, tensor=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise FormatError(f"invalid data_offsets {offsets!r}", path=path, tensor=name)
    result = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
    if result.numel * _DTYPE_SIZES[dtype] != result.nbytes:
        raise FormatError(
            f"shape {shape} of {dtype} needs {result.numel * _DTYPE_SIZES[dtype]} bytes, "
            f"offsets give {result.nbytes}",
            path=path,
            tensor=name,
        )
    return result


def _check_layout(tensors: dict[str, TensorInfo], data_size: int | None, path: str | None) -> None:
    """Offsets must tile [0, data_size) without gaps or overlaps (safetensors' own rule)."""
    position = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != position:
            raise FormatError(
                f"data offsets leave a gap or overlap at byte {position}", path=path, tensor=name
            )
        position = info.end
    if data_size is not None and position != data_size:
        raise FormatError(
            f"data section is {data_size} bytes but tensors cover {position}", path=path
        )
