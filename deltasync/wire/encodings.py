"""The encodings a file may carry, as the wire knows them: one `Encoding` per tag.

An encoding is registered once, with what every reader and writer of headers needs to know of
it: whether it is an anchor's or a delta's, the protocol that introduced it (an older file never
carries it), the metadata keys it writes beside `encoding` (its `format` name among them), the
safetensors keys a delta stores per changed tensor (suffix and dtype), and whether the file holds
the weights at all (a virtual anchor names a checkpoint instead). How an encoding codes tensors
lives with its codec (`deltasync.codec.registry`, registered from each codec's module); this
table is torch-free, so that header readers (verify, the dashboard's tools) need no codec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from deltasync.errors import FormatError

__all__ = ["Encoding", "Kind", "holds_weights", "register", "spec_of", "tags"]

Kind = Literal["anchor", "delta"]


@dataclass(frozen=True)
class Encoding:
    """An encoding's wire facts.

    Args:
        tag: the value of the `encoding` metadata key.
        kind: the kind of file that may carry it.
        since_protocol: the protocol number that introduced it.
        metadata: the keys it writes into every file's metadata (`format` among them).
        suffixes: a delta's keys per changed tensor, `<name><suffix>`, in order.
        dtypes: the safetensors dtype of each suffix's 1-D tensor.
        holds_weights: False for a file that names where the weights are instead.
    """

    tag: str
    kind: Kind
    since_protocol: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    suffixes: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    holds_weights: bool = True

    def __post_init__(self) -> None:
        if len(self.suffixes) != len(self.dtypes) or (self.kind == "delta") != bool(self.suffixes):
            raise ValueError(f"encoding {self.tag!r}: a delta's suffixes and dtypes, in pairs")


_REGISTRY: dict[str, Encoding] = {}


def register(spec: Encoding) -> Encoding:
    """Add `spec` to the table (a tag is registered once) and return it."""
    if spec.tag in _REGISTRY:
        raise ValueError(f"encoding {spec.tag!r} is registered already")
    _REGISTRY[spec.tag] = spec
    return spec


def spec_of(tag: str, *, path: str | None = None) -> Encoding:
    """The registered encoding `tag`; `FormatError` names the known ones otherwise."""
    found = _REGISTRY.get(tag)
    if found is None:
        raise FormatError(f"unknown encoding {tag!r}; known: {', '.join(_REGISTRY)}", path=path)
    return found


def holds_weights(tag: str) -> bool:
    """Whether a file of encoding `tag` holds its weights (not one naming a checkpoint); a tag
    nobody registered is taken at its word (its header, when read, is refused)."""
    found = _REGISTRY.get(tag)
    return found is None or found.holds_weights


def tags(kind: Kind, protocol: int | None = None) -> tuple[str, ...]:
    """The tags of `kind` in registration order (the preferred first), those a file of
    `protocol` may carry when given."""
    return tuple(
        spec.tag
        for spec in _REGISTRY.values()
        if spec.kind == kind and (protocol is None or spec.since_protocol <= protocol)
    )


# Deltas in the order `--encoding` lists them (`deltasync.defaults.ENCODING` is the default);
# `coo` is TRL's sparse weight patch, which loaders that know its `format` read as it is. Anchors:
# every tensor whole, or (virtual) a header naming the checkpoint that holds them; no loader may
# take a virtual anchor for a checkpoint, so its `format` is its own.
_U8 = ("U8", "U8")
for _spec in (
    Encoding("ans", "delta", 4, {"format": "deltasync_ans", "ans": "rans14-gap+zigzag-bitdiff"},
             (".gaps", ".vals"), _U8),
    Encoding("ctx", "delta", 6, {"format": "deltasync_ctx", "ctx": "exponent-groups/tiles/rans14"},
             (".ctx",), ("U8",)),
    Encoding("packed", "delta", 1,
             {"format": "deltasync_packed", "packed": "leb128-gap+zigzag-bitdiff/zstd"},
             (".gaps", ".vals"), _U8),
    Encoding("coo", "delta", 1, {"format": "sparse_weight_patch", "version": "1"},
             (".indices", ".values"), ("I32", "BF16")),
    Encoding("full", "anchor", 1, {"format": "pt"}),
    Encoding("virtual", "anchor", 4, {"format": "deltasync_virtual"}, holds_weights=False),
):  # fmt: skip
    register(_spec)
