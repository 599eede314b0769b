"""`LatencyStore` (a bucket with real latency) and `Store.get_sized` (parallel ranged reads)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from store_conformance import StoreConformance

from deltasync.store import LocalStore, MissingFile, RefusedObject, Store, open_store
from deltasync.store.latency import Call, LatencyStore

KIB = 1024


@pytest.fixture
def make_store(tmp_path: Path):
    return lambda name: LatencyStore(LocalStore(tmp_path / name), latency_s=0, bandwidth=None)


class TestLatencyStore(StoreConformance):
    """The wrapper is a bucket like any other."""


def test_calls_are_counted_by_kind_path_and_version(tmp_path: Path) -> None:
    store = LatencyStore(LocalStore(tmp_path), latency_s=0, bandwidth=None)
    store.put("runs/r/deltas/00000007-abc.safetensors", b"x" * 10)
    store.get("runs/r/deltas/00000007-abc.safetensors")
    store.publish("manifest.json", b"{}")
    store.get_range("manifest.json", 0, 1)
    store.delete("runs/r/metrics/00000003.json")
    with pytest.raises(MissingFile):
        store.get("other.bin")
    found = [(c.kind, c.target, c.version, c.bytes) for c in store.calls]
    assert found == [
        ("put", "delta", 7, 10),
        ("get", "delta", 7, 10),
        ("publish", "manifest", None, 2),
        ("get_range", "manifest", None, 1),
        ("delete", "metrics", 3, 0),
        ("get", "other", None, 0),  # a failed call still costs its round trip
    ]
    assert all(isinstance(c, Call) for c in store.calls)


def test_each_call_costs_a_round_trip_and_its_transfer(tmp_path: Path) -> None:
    store = LatencyStore(LocalStore(tmp_path), latency_s=0.05, bandwidth=10e6)
    store.inner.put("a.bin", b"\0" * 1_000_000)
    started = time.monotonic()
    store.exists("a.bin")
    store.get("a.bin")
    assert time.monotonic() - started >= 2 * 0.05 + 0.1


def _stores(tmp_path: Path) -> list[Store]:
    return [LocalStore(tmp_path / "local"), open_store(f"memory://{tmp_path.name}/bucket")]


@pytest.mark.parametrize("backend", [0, 1], ids=["local", "memory"])
def test_get_sized_reads_ranges_bitwise(tmp_path: Path, backend: int) -> None:
    inner = _stores(tmp_path)[backend]
    data = os.urandom(1000 * KIB + 7)
    inner.put("big.bin", data)
    store = LatencyStore(inner, latency_s=0, bandwidth=None)
    store.range_bytes = 64 * KIB
    assert store.get_sized("big.bin", len(data)) == data
    ranges = [c for c in store.calls if c.kind == "get_range"]
    assert len(ranges) == len(store.calls) == 16  # 1000 KiB + 7 in 64 KiB ranges
    assert sum(c.bytes for c in ranges) == len(data)


@pytest.mark.parametrize("backend", [0, 1], ids=["local", "memory"])
def test_get_sized_keeps_the_size_bound(tmp_path: Path, backend: int) -> None:
    inner = _stores(tmp_path)[backend]
    data = os.urandom(512 * KIB)
    inner.put("big.bin", data)
    store = LatencyStore(inner, latency_s=0, bandwidth=None)
    store.range_bytes = 64 * KIB
    declared = len(data) - 100
    with pytest.raises(RefusedObject, match="larger than"):
        store.get_sized("big.bin", declared)
    assert sum(c.bytes for c in store.calls) == declared + 1  # never more than size + 1
    assert store.get_sized("big.bin", len(data) + 100) == data  # shorter: short, caller checks
    with pytest.raises(MissingFile):
        store.get_sized("missing.bin", len(data))


def test_small_objects_and_one_stream_take_one_get(tmp_path: Path) -> None:
    store = LatencyStore(LocalStore(tmp_path), latency_s=0, bandwidth=None)
    store.inner.put("a.bin", b"abc" * 1000)
    store.range_bytes = 2 * KIB
    assert store.get_sized("a.bin", 3000) == b"abc" * 1000  # under two ranges
    store.range_bytes, store.range_workers = KIB, 1
    assert store.get_sized("a.bin", 3000) == b"abc" * 1000
    assert [c.kind for c in store.calls] == ["get", "get"]


@pytest.mark.whole_machine  # a ratio of timings
def test_parallel_ranges_beat_one_stream(tmp_path: Path) -> None:
    """With a bandwidth cap per stream, 8 ranges at once move about 8x the bytes per second."""
    data = os.urandom(4 * 1024 * KIB)
    LocalStore(tmp_path).put("anchor.bin", data)

    def read(workers: int) -> float:
        store = LatencyStore(LocalStore(tmp_path), latency_s=0.01, bandwidth=20e6)
        store.range_bytes, store.range_workers = 512 * KIB, workers
        started = time.monotonic()
        assert store.get_sized("anchor.bin", len(data)) == data
        return time.monotonic() - started

    one, parallel = read(1), read(8)
    assert one >= len(data) / 20e6
    assert parallel < one / 3
