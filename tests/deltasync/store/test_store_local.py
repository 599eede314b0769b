"""The conformance suite on a local folder, plus what only `LocalStore` promises (temp + rename)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from store_conformance import BAD_PATHS, StoreConformance

from deltasync.errors import StoreError
from deltasync.store import LocalStore, Store


@pytest.fixture
def make_store(tmp_path: Path):
    return lambda name: LocalStore(tmp_path / name)


class TestLocalStore(StoreConformance):
    pass


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_root_is_created(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "new" / "bucket")
    assert (tmp_path / "new" / "bucket").is_dir()
    assert store.list() == []


def test_put_leaves_no_temp_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put("a.bin", b"1")
    store.put("a.bin", b"2")
    store.put("sub/b.bin", b"3")
    assert _temp_files(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "bucket").rglob("*")) == ["a.bin", "b.bin", "sub"]


def test_objects_are_as_readable_as_files_the_user_writes(tmp_path: Path) -> None:
    """A replica or dashboard running as another user (a container's uid 1000) reads them."""
    old = os.umask(0o022)
    try:
        store = LocalStore(tmp_path)
        store.put("runs/r/manifest.json", b"{}")
        store.swap("manifest.json", b"{}", expected=None)
    finally:
        os.umask(old)
    for path in (tmp_path / "runs/r/manifest.json", tmp_path / "manifest.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, oct(path.stat().st_mode)


def test_list_hides_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put("sub/b.bin", b"3")
    (tmp_path / "bucket" / ".tmp-abc").write_bytes(b"partial")
    (tmp_path / "bucket" / "sub" / ".tmp-def").write_bytes(b"partial")
    assert store.list() == ["sub/b.bin"]
    assert store.list("sub") == ["sub/b.bin"]


def test_failed_replace_keeps_previous_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put("a.bin", b"old")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StoreError, match="disk full") as info:
        store.put("a.bin", b"new")
    monkeypatch.undo()
    assert info.value.path == "a.bin"
    assert store.get("a.bin") == b"old"
    assert store.list() == ["a.bin"]
    assert _temp_files(tmp_path) == []


def test_failed_write_of_new_file_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "bucket")

    def boom(fd: int) -> None:
        raise OSError("io error")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(StoreError, match="io error"):
        store.put("sub/a.bin", b"new")
    monkeypatch.undo()
    assert not store.exists("sub/a.bin")
    assert store.list() == []
    assert _temp_files(tmp_path) == []


def test_interrupt_during_write_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put("a.bin", b"old")

    def interrupt(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        store.put("a.bin", b"new")
    monkeypatch.undo()
    assert store.get("a.bin") == b"old"
    assert _temp_files(tmp_path) == []


@pytest.mark.parametrize("path", BAD_PATHS.values(), ids=BAD_PATHS.keys())
@pytest.mark.parametrize("method", ["put", "publish"])
def test_bad_path_writes_nothing_outside_root(tmp_path: Path, method: str, path: object) -> None:
    sibling = tmp_path / "sibling"
    sibling.mkdir()
    store: Store = LocalStore(tmp_path / "bucket")
    with pytest.raises(StoreError):
        getattr(store, method)(path, b"payload")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bucket", "sibling"]
    assert list(sibling.iterdir()) == []
    assert list((tmp_path / "bucket").iterdir()) == []


def test_absolute_path_does_not_escape(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    outside = tmp_path / "outside" / "x.bin"
    with pytest.raises(StoreError):
        store.put(str(outside), b"payload")
    assert not (tmp_path / "outside").exists()
    assert list((tmp_path / "bucket").iterdir()) == []


def test_sibling_escape_does_not_write(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    (tmp_path / "sibling").mkdir()
    with pytest.raises(StoreError):
        store.put("../sibling/x.bin", b"payload")
    assert list((tmp_path / "sibling").iterdir()) == []


def test_a_store_counts_the_bytes_it_read(tmp_path):
    """What a reader fetched, whole or by range (a worker's status reports it)."""
    store = LocalStore(tmp_path)
    store.put("a", b"x" * 100)
    assert store.bytes_read == 0
    store.get("a")
    store.get_range("a", 10, 30)
    store.get_sized("a", 100)
    assert store.bytes_read == 100 + 20 + 100


def test_a_write_that_finishes_while_abandoned_writes_are_listed_is_not_one(tmp_path, monkeypatch):
    """Another writer renames its temporary file between the listing and its stat (two
    publishers racing, one of them taking over): that file is simply not abandoned."""
    store = LocalStore(tmp_path)
    (tmp_path / ".tmp-finishing").write_bytes(b"x")
    real_lstat = os.lstat

    def renamed_meanwhile(path, *args, **kwargs):
        if str(path).endswith(".tmp-finishing"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", renamed_meanwhile)
    assert store.abandoned_writes(0.0) == {}
