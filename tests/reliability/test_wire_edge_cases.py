"""Named regression cases for what the fuzzers found: JSON no encoder writes, numbers Python will
not parse, non-string dtypes, labels that disagree with the chain, and deltas that describe a
different model. Each is refused with a `FormatError` and changes nothing."""

from __future__ import annotations

import json

import pytest
from wire_samples import bitwise_equal, build_chain, fingerprint, join, replica_at, split

from deltasync.codec import read_metadata
from deltasync.errors import FormatError
from deltasync.wire.header import header_budget
from deltasync.wire.manifest import Manifest

CHAIN = build_chain(3)
DELTA = CHAIN.deltas["packed", 2]


def _refused(blob: bytes, start: int | None = 1, error=FormatError) -> str:
    replica = replica_at(CHAIN, start)
    before = fingerprint(replica)
    with pytest.raises(error) as info:
        replica.update(blob, path="runs/run/deltas/x.safetensors")
    assert fingerprint(replica) == before
    return str(info.value)


def _raw_header(text: str, data: bytes = b"") -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _with_metadata(blob: bytes, **changes: str) -> bytes:
    header, data = split(blob)
    header["__metadata__"] |= changes
    return join(header, data)


def _with_tensor_entries(blob: bytes, edit) -> bytes:
    header, data = split(blob)
    entries = json.loads(header["__metadata__"]["tensors"])
    edit(entries)
    header["__metadata__"]["tensors"] = json.dumps(entries)
    return join(header, data)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_header(depth: int) -> None:
    blob = _raw_header("[" * depth + "]" * depth)
    assert "not valid JSON" in _refused(blob, start=None)  # a reader that knows no model
    assert _budget_or(blob, "not valid JSON") in _refused(blob)


def _budget_or(blob: bytes, parsed: str) -> str:
    """What a replica holding the 3-tensor model says: headers past what its model can need
    are refused by their length, unread; smaller ones fail as `parsed`."""
    fits = len(blob) - 8 <= header_budget(len(CHAIN.states[1]))
    return parsed if fits else "what this reader's model can need"


def test_header_number_longer_than_python_parses() -> None:
    text = '{"a.weight":{"dtype":"BF16","shape":[' + "9" * 5000 + '],"data_offsets":[0,0]}}'
    assert "not valid JSON" in _refused(_raw_header(text))


@pytest.mark.parametrize("dtype", [["BF16"], {"BF16": 1}, None, 2])
def test_dtype_that_is_not_a_string(dtype) -> None:
    header, data = split(DELTA)
    next(v for k, v in header.items() if k != "__metadata__")["dtype"] = dtype
    assert "unknown dtype" in _refused(join(header, data))


@pytest.mark.parametrize("version", ["\u00b2", "\u0662", "9" * 5000, "+2", " 2", "2.0"])
def test_version_that_is_not_plain_ascii_decimal(version: str) -> None:
    assert "model_version" in _refused(_with_metadata(DELTA, model_version=version))


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a.weight":[[' + "7" * 5000 + "]]}"])
def test_tensors_metadata_that_python_cannot_parse(text: str) -> None:
    blob = _with_metadata(DELTA, tensors=text)
    assert "'tensors' is not JSON" in _refused(blob, start=None)
    assert _budget_or(blob, "'tensors' is not JSON") in _refused(blob)


def test_read_metadata_refuses_the_same_headers() -> None:
    """The dashboard's header-only path shares the parser: same error type."""
    for blob in (
        _raw_header("[" * 100_000 + "]" * 100_000),
        _with_metadata(DELTA, tensors="[" * 5000),
    ):
        with pytest.raises(FormatError):
            read_metadata(lambda a, b, d=blob: d[a:b], len(blob))


@pytest.mark.parametrize(("version", "base"), [("3", "1"), ("9", "1"), ("2", "0")])
def test_delta_must_go_from_the_previous_version(version: str, base: str) -> None:
    """A one-bit flip turns model_version "2" into "3": a delta still names its exact base,
    which must be the version before it (bucket_layout.md), or the label is corrupt."""
    blob = _with_metadata(DELTA, model_version=version, base_version=base)
    assert "base_version" in _refused(blob)


def test_delta_naming_a_tensor_the_replica_lacks() -> None:
    """An unchanged entry for an unknown tensor: the file describes another model."""
    blob = _with_tensor_entries(DELTA, lambda e: e.update({"zzz.weight": [[4], "0" * 32, 0]}))
    assert "zzz.weight" in _refused(blob)


def test_delta_omitting_a_tensor_the_replica_holds() -> None:
    blob = _with_tensor_entries(DELTA, lambda e: e.pop("c.weight"))
    assert "c.weight" in _refused(blob)


def test_delta_with_another_shape_for_an_unchanged_tensor() -> None:
    blob = _with_tensor_entries(DELTA, lambda e: e["c.weight"].__setitem__(0, [64]))
    assert "c.weight" in _refused(blob)


def test_the_unchanged_delta_still_applies() -> None:
    replica = replica_at(CHAIN, 1)
    assert replica.update(DELTA) is True
    assert bitwise_equal(replica.tensors, CHAIN.states[2])


def _manifest_doc() -> dict:
    from deltasync.wire.manifest import ChainEntry, file_path

    digest = "0" * 32
    entry = ChainEntry(1, "anchor", file_path("run", "anchor", 1, digest), 10, digest, "full", 1)
    return json.loads(Manifest("run", 1, (entry,), (), 10).to_json())


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"run_id": ' + "1" * 5000 + "}",
        json.dumps(_manifest_doc() | {"updated_at": 10**400}),
    ],
    ids=["nested", "long-number", "updated-at-overflows-float"],
)
def test_manifest_that_python_cannot_parse(text: str) -> None:
    with pytest.raises(FormatError):
        Manifest.from_json(text.encode())
