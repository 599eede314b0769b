"""How each delta encoding codes tensors: one `DeltaCodec` per tag, registered by its module.

`deltasync.wire.encodings` holds what the wire knows of an encoding (its tag, the protocol that
introduced it, its metadata, its keys and dtypes); a codec adds how changes become those arrays
and back. `codec.files` looks the codec up by the file's tag and never branches on a name; a new
encoding is its wire entry and a module that registers its codec here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.kernels.changes import TensorChange
from deltasync.wire.encodings import Encoding, spec_of

__all__ = ["DeltaCodec", "HeldBase", "TensorToDecode", "codec_of", "register_codec"]


class HeldBase(Protocol):
    """A base that stays where it lives (a device sink's), for codecs that decode there."""

    def held(self, name: str) -> tuple[torch.Tensor, list[TensorChange] | None]: ...


@dataclass(frozen=True)
class TensorToDecode:
    """One changed tensor of a delta, as a codec's `decode` gets it.

    Args:
        name: the tensor's name.
        arrays: its stored arrays, in the order of the encoding's suffixes.
        changed: how many elements the metadata says changed.
        shape: the tensor's full shape.
        target: the base values to decode against (zeros when `held` is given).
        rows: the rows of dim 0 a part's arrays cover (None: all).
        offset: `target` holds the tensor from this flat index on (a rank's rows).
        box: the reader holds this box of the tensor (a tensor-parallel worker).
        held: where the base lives, for a codec that decodes there (`device_decode`).
    """

    name: str
    arrays: tuple[torch.Tensor, ...]
    changed: int
    shape: tuple[int, ...]
    target: torch.Tensor
    rows: tuple[int, int] | None = None
    offset: int = 0
    box: Box | None = None
    held: HeldBase | None = None


Encode = Callable[
    [
        Mapping[str, TensorChange],  # changes
        Mapping[str, tuple[int, ...]],  # shapes
        Mapping[str, torch.Tensor] | None,  # base (codecs with `needs_base`)
        Mapping[str, tuple[int, int]] | None,  # rows of a part
    ],
    dict[str, torch.Tensor],
]


@dataclass(frozen=True)
class DeltaCodec:
    """A delta encoding's codec.

    Args:
        wire: the encoding's wire facts.
        encode: changes -> the file's arrays, keyed `<name><suffix>`.
        decode: one tensor's arrays -> its changes (validated; the target is never mutated).
        needs_base: `encode` codes against the base (it must be given).
        steps_from_base: values are coded as steps from the base modulo 2**16 (decoded against
            zeros they are the steps), not as themselves; a base read only at the changed
            indices is added afterwards.
        device_decode: `decode` can work where the base lives (`TensorToDecode.held`).
    """

    wire: Encoding
    encode: Encode
    decode: Callable[[TensorToDecode], TensorChange]
    needs_base: bool = False
    steps_from_base: bool = True
    device_decode: bool = False


_CODECS: dict[str, DeltaCodec] = {}


def register_codec(
    tag: str,
    *,
    encode: Encode,
    decode: Callable[[TensorToDecode], TensorChange],
    needs_base: bool = False,
    steps_from_base: bool = True,
    device_decode: bool = False,
) -> DeltaCodec:
    """Register the codec of the delta encoding `tag` (registered with the wire already)."""
    wire = spec_of(tag)
    if wire.kind != "delta" or tag in _CODECS:
        raise ValueError(f"{tag!r}: a codec is for a delta encoding, registered once")
    found = DeltaCodec(wire, encode, decode, needs_base, steps_from_base, device_decode)
    _CODECS[tag] = found
    return found


def codec_of(tag: str) -> DeltaCodec:
    """The codec of delta encoding `tag`; `FormatError` if none is registered."""
    found = _CODECS.get(tag)
    if found is None:
        raise FormatError(f"no codec for encoding {tag!r}; known: {', '.join(_CODECS)}")
    return found
