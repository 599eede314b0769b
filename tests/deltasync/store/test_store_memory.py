"""The conformance suite on `memory://`, each test in its own root, removed afterwards."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from store_conformance import StoreConformance

from deltasync.store import Store, open_store


@pytest.fixture
def make_store():
    base = f"/deltasync-test-{uuid.uuid4().hex}"
    opened: list[Store] = []

    def make(name: str) -> Store:
        opened.append(open_store(f"memory://{base}/{name}"))
        return opened[-1]

    yield make
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)
    assert not [p for p in [*fs.store, *fs.pseudo_dirs] if p.startswith(base)]


class TestMemoryStore(StoreConformance):
    pass
