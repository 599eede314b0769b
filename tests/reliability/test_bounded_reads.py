"""Reads are bounded: a folder bucket opens only regular files inside it, and every read of a
manifest or a chain file stops one byte past what the reader expects.

Each case is a probe from the reliability issue turned around: a symlink to a secret outside
the bucket, `manifest.json -> /dev/zero`, a FIFO, a file larger than its manifest entry.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from deltasync.errors import FormatError
from deltasync.store import LocalStore, RefusedObject, RetryPolicy, open_store
from deltasync.store import retry as retry_module
from deltasync.wire.manifest import (
    MANIFEST_PATH,
    MANIFEST_PROBE_BYTES,
    MAX_MANIFEST_BYTES,
    PartRef,
    fetch_file,
    read_manifest,
    read_manifest_bytes,
)

SECRET = b"root:x:0:0:secret-line\n"


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal is final: any retry would sleep first, which fails the test."""

    def refuse_sleep(seconds: float) -> None:
        raise AssertionError(f"a refused read was retried (sleep {seconds})")

    monkeypatch.setattr(retry_module.time, "sleep", refuse_sleep)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "bucket", retry=RetryPolicy(attempts=4, backoff_s=1.0))


def _secret(tmp_path: Path) -> Path:
    target = tmp_path / "outside" / "passwd"
    target.parent.mkdir()
    target.write_bytes(SECRET)
    return target


def test_symlink_out_of_the_bucket_is_refused_without_leaking(
    store: LocalStore, tmp_path: Path
) -> None:
    (Path(store.root) / "leak.bin").symlink_to(_secret(tmp_path))
    for read in (
        lambda: store.get("leak.bin"),
        lambda: store.get("leak.bin", limit=100),
        lambda: store.get_range("leak.bin", 0, 8),
        lambda: store.size("leak.bin"),
    ):
        with pytest.raises(RefusedObject, match="symlink") as caught:
            read()
        assert b"root" not in str(caught.value).encode() and "secret" not in str(caught.value)


def test_symlinked_folder_inside_the_bucket_is_refused(store: LocalStore, tmp_path: Path) -> None:
    _secret(tmp_path)
    (Path(store.root) / "runs").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(RefusedObject, match="symlink"):
        store.get("runs/passwd")


def test_manifest_pointing_at_dev_zero_is_refused(store: LocalStore) -> None:
    (Path(store.root) / MANIFEST_PATH).symlink_to("/dev/zero")
    with pytest.raises(RefusedObject, match="symlink"):
        read_manifest(store)


def test_fifo_does_not_block_the_reader(store: LocalStore) -> None:
    os.mkfifo(Path(store.root) / MANIFEST_PATH)
    outcome: list[BaseException | bytes | None] = []

    def read() -> None:
        try:
            outcome.append(read_manifest_bytes(store))
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], RefusedObject) and "FIFO" in str(outcome[0])


def test_regular_files_still_read(store: LocalStore) -> None:
    store.put("runs/a.bin", b"abcdef")
    assert store.get("runs/a.bin") == b"abcdef"
    assert store.get("runs/a.bin", limit=6) == b"abcdef"
    assert store.get_range("runs/a.bin", 2, 4) == b"cd"
    assert store.size("runs/a.bin") == 6


@pytest.mark.parametrize("url", ["memory://bounded-reads", "folder"])
def test_get_with_limit_reads_at_most_one_byte_past_it(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(str(tmp_path / url) if url == "folder" else url)
    store.put("big.bin", b"x" * 10_000)
    ends: list[int | None] = []
    read = store._read
    monkeypatch.setattr(store, "_read", lambda full, end: ends.append(end) or read(full, end))
    with pytest.raises(RefusedObject, match="larger than the 1000 bytes expected"):
        store.get("big.bin", limit=1000)
    assert ends == [1001]
    assert store.get("big.bin", limit=10_000) == b"x" * 10_000


def test_chain_file_larger_than_its_entry_is_read_only_to_the_limit(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest entry declaring 1,000 bytes for a 2 MB file: at most 1,001 bytes are read."""
    store.put("runs/r/deltas/00000002-abc.safetensors", b"\0" * 2_000_000)
    ends: list[int | None] = []
    read = store._read
    monkeypatch.setattr(store, "_read", lambda full, end: ends.append(end) or read(full, end))
    ref = PartRef("runs/r/deltas/00000002-abc.safetensors", 1000, "0" * 32, None)
    with pytest.raises(FormatError, match="does not match the manifest"):
        fetch_file(store, ref)
    assert ends == [1001]


def test_oversized_manifest_is_not_downloaded(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the one-round-trip probe is read (`MANIFEST_PROBE_BYTES` + 1), never the whole."""
    (Path(store.root) / MANIFEST_PATH).write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    ends: list[int | None] = []
    read = store._read
    monkeypatch.setattr(store, "_read", lambda full, end: ends.append(end) or read(full, end))
    with pytest.raises(FormatError, match="exceeds"):
        read_manifest_bytes(store)
    assert ends == [MANIFEST_PROBE_BYTES + 1]
