"""Size limits are checked before anything proportional to a claimed size is read or allocated.

`tests/deltasync/codec/test_bad_input.py` already shows that a header past 64 MiB and a zstd frame
declaring 10 MB are refused; here the same limits are shown to hold *before* reading or
allocating: a spy on byte-range reads, and `tracemalloc` peaks (Python, numpy and zstd output
buffers are traced; a bound of a few MiB is far below any claimed size, so an allocation
proportional to a claim would show at once).
"""

from __future__ import annotations

import contextlib
import json
import struct
import tracemalloc
from collections.abc import Iterator

import pytest
import zstandard
from mutations import replace_tensor
from wire_samples import build_chain, fingerprint, join, replica_at, split

from deltasync.codec import read_metadata
from deltasync.errors import FormatError
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire import header as header_module
from deltasync.wire.header import MAX_HEADER_BYTES, parse_header
from deltasync.wire.manifest import MANIFEST_PATH, MAX_MANIFEST_BYTES, read_manifest

CHAIN = build_chain(2)
MIB = 2**20
# What a refusal may allocate at most: parsing a small header, formatting an error message.
SMALL = 4 * MIB


@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """Peak traced bytes allocated inside the block (the inputs were built before it)."""
    result = [0]
    tracemalloc.start()
    try:
        yield result
    finally:
        result[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


class SpyFile:
    """A file of any claimed size that only serves the bytes it has, logging every range read."""

    def __init__(self, prefix: bytes, size: int):
        self.prefix, self.size, self.reads = prefix, size, []

    def read(self, start: int, end: int) -> bytes:
        self.reads.append((start, end))
        assert end <= len(self.prefix), f"read {start}..{end} past the header"
        return self.prefix[start:end]


def _refused(replica: Replica, blob: bytes) -> tuple[str, int]:
    """Refusal message and peak allocation of `replica.update(blob)`; the state is unchanged."""
    before = fingerprint(replica)
    with peak_memory() as peak, pytest.raises(FormatError) as info:
        replica.update(blob, path="x.safetensors")
    assert fingerprint(replica) == before
    return str(info.value), peak[0]


@pytest.mark.parametrize("claimed", [MAX_HEADER_BYTES + 1, 2**40, 2**64 - 1])
def test_header_length_is_checked_before_the_header_is_read(claimed: int, record_property) -> None:
    spy = SpyFile(struct.pack("<Q", claimed), size=2**62)
    with peak_memory() as peak, pytest.raises(FormatError, match="header size"):
        parse_header(spy.read, spy.size)
    assert spy.reads == [(0, 8)]
    assert peak[0] < SMALL
    record_property("peak_bytes", peak[0])


def _huge_anchor_header(dims: list[int]) -> bytes:
    """A consistent anchor header for one BF16 tensor of shape `dims` (data not included)."""
    numel = 1
    for d in dims:
        numel *= d
    meta = json.loads(json.dumps(split(CHAIN.anchors[1])[0]["__metadata__"]))
    meta["tensors"] = json.dumps({"a.weight": [dims, "0" * 32, numel]})
    header = {
        "__metadata__": meta,
        "a.weight": {"dtype": "BF16", "shape": dims, "data_offsets": [0, 2 * numel]},
    }
    return join(header, b"")


def test_header_claiming_2_40_elements_is_refused_without_reading_data(record_property) -> None:
    """2**40 bf16 elements (2 TiB) in a file of a few hundred bytes: the offsets do not fit."""
    blob = _huge_anchor_header([2**20, 2**20]) + b"\0" * 64
    message, peak = _refused(replica_at(CHAIN, 1), blob)
    assert "data section" in message
    assert peak < SMALL
    record_property("peak_bytes", peak)


def test_header_of_a_2_tib_file_is_read_alone(record_property) -> None:
    """Header-only inspection (the dashboard, `inspect`) of a file that claims 2 TiB of data
    reads the 8-byte prefix and the header, nothing of the data section."""
    prefix = _huge_anchor_header([2**20, 2**20])
    spy = SpyFile(prefix, size=len(prefix) + 2**41)
    with peak_memory() as peak:
        meta, header = read_metadata(spy.read, spy.size)
    assert header.tensors["a.weight"].numel == 2**40 and meta.total_elements == 2**40
    assert spy.reads == [(0, 8), (8, len(prefix))]
    assert peak[0] < SMALL
    record_property("peak_bytes", peak[0])


def test_tensor_count_is_checked_before_any_entry_is_validated(monkeypatch, record_property):
    """The count limit applies to the parsed header before a single entry is looked at (the
    limit is lowered to 1,000 here so that the test stays fast; the JSON text itself is bounded
    by the header size, see RELIABILITY.md for the full-size numbers)."""
    monkeypatch.setattr(header_module, "MAX_TENSORS", 1000)
    seen = []
    real = header_module._tensor_info
    monkeypatch.setattr(header_module, "_tensor_info", lambda *a: seen.append(a[0]) or real(*a))
    entry = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    blob = join({f"t{i}": entry for i in range(1001)}, b"")
    message, peak = _refused(replica_at(CHAIN, 1), blob)
    assert "1001 tensors, at most 1000" in message
    assert seen == []
    assert peak < 25 * len(blob)  # the parsed JSON, linear in the header's size
    record_property("peak_bytes", peak)
    record_property("header_bytes", len(blob))


def test_a_replica_that_knows_its_model_refuses_a_big_header_unparsed(monkeypatch, record_property):
    """The header's size is bounded by the tensor set the reader holds (3 tensors here: 76 KiB)
    before its JSON is read: 100,000 entries (5 MB of header) cost nothing to refuse, where a
    reader that knows no model would parse them first (RELIABILITY.md: 8.3 s at 10^6)."""
    entry = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    blob = join({f"t{i}": entry for i in range(100_000)}, b"")
    parsed = []
    monkeypatch.setattr(header_module.json, "loads", lambda raw: parsed.append(raw) or {})
    message, peak = _refused(replica_at(CHAIN, 1), blob)
    assert "what this reader's model can need" in message and parsed == []
    assert peak < 64 * 1024
    record_property("peak_bytes", peak)
    record_property("header_bytes", len(blob))


@pytest.mark.parametrize(
    ("dims", "changed"),
    [([2**20, 2**20], 2**40), ([2**40], 5), ([32, 16], 2**40)],
    ids=["2**40-elements", "2**40-shape", "count-past-shape"],
)
def test_metadata_element_counts_are_checked_before_decoding(dims, changed, record_property):
    """The `tensors` metadata claims a huge tensor or change count for a real tensor."""
    header, data = split(CHAIN.deltas["packed", 2])
    entries = json.loads(header["__metadata__"]["tensors"])
    entries["a.weight"] = [dims, entries["a.weight"][1], changed]
    header["__metadata__"]["tensors"] = json.dumps(entries)
    _, peak = _refused(replica_at(CHAIN, 1), join(header, data))
    assert peak < SMALL
    record_property("peak_bytes", peak)


def _with_gaps_frame(frame: bytes) -> bytes:
    """The packed delta 1 -> 2 with `a.weight.gaps` replaced by `frame` (offsets rebuilt)."""
    header, data = split(CHAIN.deltas["packed", 2])
    return replace_tensor(header, data, "a.weight.gaps", "U8", [len(frame)], frame)


def test_zstd_frame_declaring_a_gigantic_size_is_not_decompressed(record_property) -> None:
    """A 16-byte frame whose header declares 1 TiB: refused from the frame header alone."""
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (2**40).to_bytes(8, "little") + b"\x01\x00\x00"
    assert zstandard.get_frame_parameters(frame).content_size == 2**40
    message, peak = _refused(replica_at(CHAIN, 1), _with_gaps_frame(frame))
    assert "declares 1099511627776 bytes" in message
    assert peak < SMALL
    record_property("peak_bytes", peak)


def test_zstd_frame_without_a_declared_size_stops_at_the_bound(record_property) -> None:
    """A streamed frame (no content size) that inflates to 64 MiB: decompression stops at the
    bound (changed x 10 bytes), so memory never follows the inflated size."""
    compressor = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = b"".join(compressor.compress(b"\0" * MIB) for _ in range(64)) + compressor.flush()
    assert len(frame) < 64 * 1024
    message, peak = _refused(replica_at(CHAIN, 1), _with_gaps_frame(frame))
    assert "gaps" in message
    assert peak < SMALL
    record_property("peak_bytes", peak)
    record_property("frame_bytes", len(frame))


def test_oversized_manifest_is_refused_before_download(tmp_path, record_property) -> None:
    store = LocalStore(tmp_path)
    store.publish(MANIFEST_PATH, b" " * (MAX_MANIFEST_BYTES + 1))
    replica = Replica()
    with peak_memory() as peak, pytest.raises(FormatError, match="not downloaded"):
        replica.sync(store)
    with pytest.raises(FormatError):
        read_manifest(store)
    assert replica.version is None and peak[0] < SMALL
    record_property("peak_bytes", peak[0])


class ReadCountingStore(LocalStore):
    """Counts the bytes each object's whole-file reads asked for."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.asked: dict[str, int | None] = {}

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        self.asked[path] = limit
        return super().get(path, limit=limit)


@pytest.mark.parametrize("streaming", [False, True], ids=["sync", "replay"])
def test_a_declared_size_past_the_model_is_refused_before_the_read(tmp_path, streaming) -> None:
    """A bucket writer declares 256 MiB for a delta of a model of a few KB (a sparse file of
    that size): a reader that holds the model refuses it from the manifest, reading nothing.
    `sync` is a replica catching up; `replay` the CLI's path (verify, replay, export)."""
    from wire_samples import publish_chain

    from deltasync.replica.replay import replay
    from deltasync.wire.policy import AnchorPolicy

    chain = build_chain(3)
    store = ReadCountingStore(tmp_path)
    policy = AnchorPolicy(interval=10, max_delta_fraction=None, keep_anchors=2)
    publish_chain(store, chain, policy=policy)
    raw = json.loads(store.get(MANIFEST_PATH))
    hostile = raw["deltas"][-1]
    hostile["bytes"] = 256 * MIB
    with open(tmp_path / hostile["path"], "r+b") as f:
        f.truncate(256 * MIB)
    store.publish(MANIFEST_PATH, json.dumps(raw).encode())
    replica = replica_at(chain, 2) if not streaming else Replica()
    store.asked.clear()
    with pytest.raises(FormatError, match="more than a delta of this model can hold"):
        if streaming:
            replay(store, read_manifest(store).plan(None, None, 3), replica)
        else:
            replica.sync(store)
    assert hostile["path"] not in store.asked
    assert replica.version == 2  # nothing of version 3 applied
