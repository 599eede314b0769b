"""Hypothesis strategies that mutate valid safetensors files into hostile inputs.

Byte-level mutations (bit flips, overwrites, truncation, extension, a rewritten length prefix)
find what a parser assumes; structural ones (a header or metadata field set to a wrong dtype,
shape, offset, count, name, version, base, run id or protocol) get past the JSON layer and reach
the checks behind it; payload ones (random zstd frames, random index arrays) reach the decoders.
"""

from __future__ import annotations

import copy
import json
import struct

import numpy as np
import zstandard
from hypothesis import strategies as st
from wire_samples import join, split

from deltasync.codec.rans import encode_integers

# Values that are wrong in interesting ways wherever a JSON value is expected.
HUGE = [2**31, 2**32, 2**40, 2**53, 2**63, 2**64, 10**30, 10**400]
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([*HUGE, -1, 0, 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
DTYPES = st.one_of(
    st.sampled_from(
        ["BF16", "F16", "F32", "F64", "U8", "I8", "I16", "I32", "I64", "U64", "BOOL", "F8_E4M3"]
    ),
    st.sampled_from(["bf16", "", "BF16 ", "object", "pickle"]),
    JSON_SCALARS,
)
SHAPES = st.one_of(
    st.lists(st.integers(0, 64), max_size=3),
    st.lists(st.sampled_from([*HUGE, -1, 0, 1, 2**20]), min_size=1, max_size=3),
    st.lists(st.one_of(st.booleans(), st.floats(), st.text(max_size=3)), min_size=1, max_size=2),
    JSON_SCALARS,
)
OFFSETS = st.one_of(
    st.lists(st.integers(-2, 4096), min_size=2, max_size=2),
    st.lists(st.sampled_from([*HUGE, -1, 0]), min_size=2, max_size=2),
    st.lists(st.integers(0, 100), max_size=3),
    JSON_SCALARS,
)
NAMES = st.one_of(
    st.sampled_from(["zzz.weight", "a.weight.extra", "", "__metadata__", "../a.weight", "a\x00"]),
    st.text(max_size=16),
)
# Metadata strings: numbers that are not plain decimals, other runs, other protocols.
META_STRINGS = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "2",
            "3",
            "-1",
            "+2",
            " 2",
            "2.0",
            "1e3",
            "\u00b2",
            "\u0662",
            "9" * 20,
            "9" * 5000,
            "other",
            "../x",
            "deltasync/2",
            "deltasync/4",
            "deltasync/5",
            "deltasync/1 ",
            "anchor",
            "delta",
            "full",
            "packed",
            "ans",
            "ctx",
            "coo",
            "xxh3-64",
            "True",
            "False",
            "{}",
            "[]",
            "null",
            "[" * 3000,
        ]
    ),
    st.text(max_size=24),
)


@st.composite
def byte_mutation(draw, blob: bytes) -> bytes:
    """Bit flips, overwrites, truncation, extension, insertion or a new length prefix."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    size = len(blob)
    kind = draw(
        st.sampled_from(
            ["flip", "flip_header", "overwrite", "truncate", "extend", "insert", "length"]
        )
    )
    data = bytearray(blob)
    if kind in ("flip", "flip_header"):
        low, high = (8, 8 + header_len - 1) if kind == "flip_header" else (0, size - 1)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(low, high))] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        at = draw(st.integers(0, size - 1))
        chunk = draw(st.binary(min_size=1, max_size=16))
        data[at : at + len(chunk)] = chunk
    elif kind == "truncate":
        del data[draw(st.integers(0, size - 1)) :]
    elif kind == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "insert":
        at = draw(st.integers(0, size))
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        value = draw(
            st.one_of(
                st.integers(0, 2**64 - 1),
                st.integers(max(0, header_len - 16), header_len + 16),
                st.sampled_from([0, 1, 2, 8, 64 * 2**20, 64 * 2**20 + 1, size, size - 8]),
            )
        )
        data[:8] = struct.pack("<Q", value)
    return bytes(data)


@st.composite
def header_edit(draw, blob: bytes) -> bytes:
    """One field of the header JSON (a tensor entry or a metadata string) set to a wrong value."""
    header, data = split(blob)
    header = copy.deepcopy(header)
    metadata = header.setdefault("__metadata__", {})
    names = sorted(k for k in header if k != "__metadata__")
    kind = draw(
        st.sampled_from(
            [
                "dtype",
                "shape",
                "offsets",
                "entry_keys",
                "rename",
                "add_tensor",
                "drop_tensor",
                "meta_value",
                "meta_drop",
                "meta_add",
                "meta_type",
                "tensors_entry",
                "tensors_names",
                "raw_token",
                "whole",
            ]
        )
    )
    if kind in ("dtype", "shape", "offsets", "entry_keys") and names:
        entry = header[draw(st.sampled_from(names))]
        if kind == "dtype":
            entry["dtype"] = draw(DTYPES)
        elif kind == "shape":
            entry["shape"] = draw(SHAPES)
        elif kind == "offsets":
            entry["data_offsets"] = draw(OFFSETS)
        else:
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            if draw(st.booleans()):
                del entry[key]
            else:
                entry["extra"] = draw(JSON_SCALARS)
    elif kind == "rename" and names:
        old = draw(st.sampled_from(names))
        header[draw(NAMES)] = header.pop(old)
    elif kind == "add_tensor":
        header[draw(NAMES)] = {
            "dtype": draw(DTYPES),
            "shape": draw(SHAPES),
            "data_offsets": draw(OFFSETS),
        }
    elif kind == "drop_tensor" and names:
        del header[draw(st.sampled_from(names))]
    elif kind == "meta_value" and metadata:
        key = draw(st.one_of(st.sampled_from(CRITICAL_KEYS), st.sampled_from(sorted(metadata))))
        metadata[key] = draw(META_STRINGS)
    elif kind == "raw_token":
        return _with_raw_token(draw, header, data)
    elif kind == "meta_drop" and metadata:
        del metadata[draw(st.sampled_from(sorted(metadata)))]
    elif kind == "meta_add":
        metadata[draw(st.text(max_size=10))] = draw(META_STRINGS)
    elif kind == "meta_type":
        if metadata and draw(st.booleans()):
            metadata[draw(st.sampled_from(sorted(metadata)))] = draw(JSON_VALUES)
        else:
            header["__metadata__"] = draw(JSON_VALUES)
    elif kind in ("tensors_entry", "tensors_names") and "tensors" in metadata:
        metadata["tensors"] = draw(_tensors_edit(metadata["tensors"], kind))
    else:
        return join(draw(JSON_VALUES), data)
    return join(header, data)


CRITICAL_KEYS = [
    "protocol",
    "run_id",
    "model_version",
    "base_version",
    "kind",
    "encoding",
    "digest_algorithm",
    "tensors",
]
# JSON text that `json.dumps` cannot produce from Python values: deep nesting, long literals.
RAW_TOKENS = st.one_of(
    st.integers(100, 20_000).map(lambda k: "[" * k + "]" * k),
    st.integers(100, 20_000).map(lambda k: '{"a":' * k + "0" + "}" * k),
    st.integers(4000, 6000).map(lambda k: "9" * k),
    st.integers(300, 400).map(lambda k: "1e" + "9" * k),
    st.sampled_from(["-0", "1.5", "NaN", "-Infinity", '"\\ud800"', "1E400"]),
)


def _with_raw_token(draw, header: dict, data: bytes) -> bytes:
    """The header with one value (a tensor field, a metadata value, or the header itself)
    replaced by raw JSON text."""
    names = sorted(k for k in header if k != "__metadata__")
    spot = draw(
        st.sampled_from(["header", "metadata", *(["dtype", "shape", "offsets"] * bool(names))])
    )
    marker = "@@RAW@@"
    if spot == "header":
        header = marker
    elif spot == "metadata":
        header["__metadata__"] = marker
    else:
        field = {"dtype": "dtype", "shape": "shape", "offsets": "data_offsets"}[spot]
        entry = header[draw(st.sampled_from(names))]
        if isinstance(entry, dict):
            entry[field] = marker
        else:
            header = marker
    text = json.dumps(header).replace(f'"{marker}"', draw(RAW_TOKENS))
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def _tensors_edit(draw, raw: str, kind: str) -> str:
    """The metadata `tensors` object with one entry's shape, digest or count, or a name, wrong."""
    if draw(st.integers(0, 9)) == 0:  # the string holds JSON text no encoder would write
        return draw(RAW_TOKENS)
    try:
        entries = json.loads(raw)  # an earlier mutation may have made it any JSON value
        json.dumps(copy.deepcopy(entries))  # nesting shallow enough to edit again
    except (ValueError, RecursionError, TypeError):
        entries = None
    if not isinstance(entries, dict) or not entries:  # an earlier mutation broke it already
        return draw(META_STRINGS)
    names = sorted(entries)
    if kind == "tensors_entry":
        name = draw(st.sampled_from(names))
        if not isinstance(entries[name], list) or len(entries[name]) < 3:
            entries[name] = [[0], "0" * 32, 0]
        entry = entries[name]
        field = draw(st.integers(0, 3))
        if field == 0:
            entry[0] = draw(SHAPES)
        elif field == 1:
            entry[1] = draw(st.one_of(st.sampled_from(["0" * 32, "f" * 32, "0" * 31]), JSON_VALUES))
        elif field == 2:
            entry[2] = draw(st.one_of(st.integers(-2, 600), st.sampled_from([*HUGE, True])))
        else:
            entry.append(draw(JSON_SCALARS))
    else:
        action = draw(st.sampled_from(["rename", "drop", "add"]))
        if action == "rename":
            entries[draw(NAMES)] = entries.pop(draw(st.sampled_from(names)))
        elif action == "drop":
            del entries[draw(st.sampled_from(names))]
        else:
            entries[draw(NAMES)] = [
                draw(SHAPES),
                "0" * 32,
                draw(st.one_of(st.integers(0, 4), st.sampled_from(HUGE))),
            ]
    return json.dumps(entries)


@st.composite
def payload_edit(draw, blob: bytes) -> bytes:
    """A payload tensor replaced: random zstd frames (packed), rANS streams (ans, ctx), a ctx
    blob's group header rewritten, or random index arrays (coo)."""
    header, data = split(blob)
    keys = sorted(k for k in header if k != "__metadata__")
    if not keys:
        return blob
    key = draw(st.sampled_from(keys))
    if key.endswith(".ctx") and draw(st.booleans()):  # its header rewritten, streams kept
        original = bytes(data[slice(*header[key]["data_offsets"])])
        groups = draw(st.integers(0, 300))
        cuts = draw(st.lists(st.integers(0, 255), max_size=4))
        payload = bytes(_leb128(groups)) + bytes(cuts) + original[1 + len(cuts) :]
        return replace_tensor(header, data, key, "U8", [len(payload)], payload)
    if key.endswith((".gaps", ".vals", ".ctx")):
        choice = draw(st.sampled_from(["zstd_random", "zstd_leb", "rans", "raw", "empty"]))
        if choice == "rans":  # a valid stream of other integers, or another count
            values = draw(st.lists(st.integers(0, 2**20) | st.integers(0, 40), max_size=40))
            payload = encode_integers(np.array(values, np.int64), draw(st.integers(0, 6))).tobytes()
        elif choice == "zstd_random":
            payload = zstandard.ZstdCompressor().compress(draw(st.binary(max_size=64)))
        elif choice == "zstd_leb":  # valid varints, wrong values or count
            values = draw(st.lists(st.integers(0, 700), max_size=40))
            payload = zstandard.ZstdCompressor().compress(
                bytes(b for v in values for b in _leb128(v))
            )
        elif choice == "raw":
            payload = draw(st.binary(min_size=1, max_size=64))
        else:
            payload = b""
        tensor = (key, "U8", [len(payload)], payload)
    elif key.endswith(".indices"):
        values = draw(
            st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 600), max_size=24)
        )
        tensor = (key, "I32", [len(values)], np.array(values, "<i4").tobytes())
    else:  # bf16 values or anchor tensors: keep the dtype, change the element count
        raw = draw(st.binary(max_size=96))
        raw = raw[: len(raw) // 2 * 2]
        tensor = (key, "BF16", [len(raw) // 2], raw)
    return replace_tensor(header, data, *tensor)


def _leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def replace_tensor(
    header: dict, data: bytes, key: str, dtype: str, shape: list[int], payload: bytes
) -> bytes:
    """Rebuild the data section with one tensor's bytes swapped (offsets stay consistent)."""
    pieces = []
    ordered = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )
    new_header = {"__metadata__": header.get("__metadata__", {})}
    position = 0
    for name in ordered:
        if name == key:
            chunk, info = payload, {"dtype": dtype, "shape": shape}
        else:
            start, end = header[name]["data_offsets"]
            chunk, info = data[start:end], {k: header[name][k] for k in ("dtype", "shape")}
        new_header[name] = info | {"data_offsets": [position, position + len(chunk)]}
        pieces.append(chunk)
        position += len(chunk)
    return join(new_header, b"".join(pieces))


def file_mutation(blob: bytes) -> st.SearchStrategy[bytes]:
    """Any of the mutations above, applied once or twice."""
    one = st.one_of(byte_mutation(blob), header_edit(blob), payload_edit(blob))
    return one.flatmap(
        lambda mutated: (
            st.one_of(st.just(mutated), _again(mutated)) if _parses(mutated) else st.just(mutated)
        )
    )


def _again(blob: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(byte_mutation(blob), header_edit(blob), payload_edit(blob))


def _parses(blob: bytes) -> bool:
    """Whether structural mutations can be stacked on `blob` (its header is plain JSON)."""
    try:
        header, _ = split(blob)
        json.dumps(copy.deepcopy(header))  # nesting shallow enough to edit again
    except (ValueError, RecursionError, struct.error):
        return False
    return (
        isinstance(header, dict)
        and all(
            isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2
            and all(isinstance(o, int) for o in v["data_offsets"])
            and "dtype" in v
            and "shape" in v
            for k, v in header.items()
            if k != "__metadata__"
        )
        and isinstance(header.get("__metadata__", {}), dict)
    )
