"""A reader's memory is what it holds plus a fixed window, whatever the anchor's size.

Each reader runs in a fresh process (`bench.reader_memory.measure`: the kernels compiled on a
small bucket first, then the peak RSS reset); its peak past that point, less the state it holds
(for `verify` and `export`, the replayed state, once), must stay within the read window plus
64 MiB at two anchor sizes. The full table, side by side with the code before, is
`python -m bench.reader_memory` (BENCHMARKS.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.reader_memory import GIB, garbage_anchor_bucket, make_bucket, measure
from deltasync.defaults import READ_WINDOW_BYTES

MIB = 1 << 20
SIZES = (0.2, 0.5)  # GiB of bf16 weights
ALLOWED = READ_WINDOW_BYTES + 64 * MIB


@pytest.fixture(scope="module")
def buckets(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("reader-memory")
    made = {}
    made["warm"] = (root / "warm", make_bucket(root / "warm", 0.02, vocab=4096))
    for gib in SIZES:
        made[f"{gib}"] = (root / f"{gib}", make_bucket(root / f"{gib}", gib))
    return made


@pytest.mark.parametrize("reader", ["sync", "verify", "export"])
def test_a_reader_holds_the_state_and_a_window_at_any_size(buckets, reader):
    warm, _ = buckets["warm"]
    beyond = {}
    for gib in SIZES:
        folder, held = buckets[f"{gib}"]
        found = measure(reader, folder, warm)
        assert found["exit"] == 0, found["said"]
        beyond[gib] = found["peak"] - found["imports"] - (found["held"] or held)
    assert max(beyond.values()) <= ALLOWED, {g: b / MIB for g, b in beyond.items()}


def test_verify_refuses_a_declared_gigabyte_of_garbage_by_its_header(buckets, tmp_path):
    """The manifest declares a 1 GiB anchor (its true size and digest) that is no safetensors
    file: refused in one line from the header alone, at a small clean bucket's peak."""
    warm, _ = buckets["warm"]
    garbage_anchor_bucket(warm / "bucket", tmp_path / "bucket", GIB)
    (tmp_path / "model").symlink_to(warm / "model")
    clean, bad = measure("verify", warm, warm), measure("verify", tmp_path, warm)
    assert bad["exit"] == 1 and "header size" in bad["said"], bad
    assert bad["peak"] - bad["imports"] <= clean["peak"] - clean["imports"] + 64 * MIB


GET_SIZED = """
import resource, sys
from deltasync.store import LocalStore
store = LocalStore(sys.argv[1])
store.range_bytes, store.range_workers = 16 << 20, 8  # a bucket's parallel ranged reads
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
data = store.get_sized("big", int(sys.argv[2]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(peak - before, len(data))
"""


def test_a_large_object_read_by_ranges_is_held_once(tmp_path):
    """`Store.get_sized` reads ranges in parallel straight into one buffer: each range's
    bytes are dropped once copied, so the object is held once."""
    size = 384 * MIB
    with open(tmp_path / "big", "wb") as f:
        f.truncate(size)
    done = subprocess.run(
        [sys.executable, "-c", GET_SIZED, str(tmp_path), str(size)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    extra, length = map(int, done.stdout.split())
    assert length == size
    assert extra <= size + 64 * MIB, extra / MIB  # joined from its ranges, it had held 1.5x
