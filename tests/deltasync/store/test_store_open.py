"""`open_store(url)`: which backend a URL gets, and which URLs are refused."""

from __future__ import annotations

import socket
from pathlib import Path

import fsspec
import pytest

from deltasync.errors import StoreError
from deltasync.store import LocalStore, Store, open_store


def test_plain_path_gives_local_store(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "bucket"))
    assert type(store) is LocalStore
    assert (tmp_path / "bucket").is_dir()
    assert store.root == str((tmp_path / "bucket").resolve())


def test_file_url_gives_local_store(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/bucket")
    assert type(store) is LocalStore
    store.put("a.bin", b"1")
    assert (tmp_path / "bucket" / "a.bin").read_bytes() == b"1"


def test_memory_url_gives_generic_store() -> None:
    store = open_store("memory://deltasync-open-test")
    assert type(store) is Store
    assert store.url == "memory://deltasync-open-test"


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("open_store must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_hf_bucket_url_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_network(monkeypatch)
    store = open_store("hf://buckets/ns/name")
    assert type(store) is Store
    assert store.url == "hf://buckets/ns/name"
    assert store.root == "buckets/ns/name"


def test_hf_bucket_url_with_prefix_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_network(monkeypatch)
    store = open_store("hf://buckets/ns/name/runs/r1/")
    assert store.root == "buckets/ns/name/runs/r1"


def test_hf_model_repo_is_refused() -> None:
    with pytest.raises(StoreError, match="not a bucket URL"):
        open_store("hf://ns/model")


def test_hf_dataset_repo_is_refused() -> None:
    with pytest.raises(StoreError, match="not a bucket URL"):
        open_store("hf://datasets/x/y")


def test_hf_bucket_without_name_is_refused() -> None:
    with pytest.raises(StoreError, match="not a bucket URL"):
        open_store("hf://buckets/ns")


def test_dotdot_in_url_is_refused() -> None:
    with pytest.raises(StoreError, match=r"contains '\.\.'"):
        open_store("memory://a/../b")
    with pytest.raises(StoreError, match=r"contains '\.\.'"):
        open_store("hf://buckets/ns/name/../other")


def test_unknown_protocol_names_the_usual_ones() -> None:
    with pytest.raises(StoreError, match="nosuch") as info:
        open_store("nosuch://x")
    for usual in ("hf://buckets/NS/NAME", "s3://", "memory://", "folder"):
        assert usual in str(info.value)


def test_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(url: str, **kwargs: object) -> None:
        raise ImportError("No module named 's3fs'")

    monkeypatch.setattr(fsspec, "url_to_fs", missing)
    with pytest.raises(StoreError, match=r"deltasync\[s3\]"):
        open_store("s3://bucket/prefix")
