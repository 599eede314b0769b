"""The worker extension registers the `deltasync` weight-transfer backend by module path, once,
and refuses to start when another engine class already holds the name."""

from __future__ import annotations

import pytest
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from deltasync.vllm_ext import BACKEND
from deltasync.vllm_ext.engine import DeltaSyncEngine
from deltasync.vllm_ext.worker import register


def test_the_backend_resolves_to_the_engine_and_registering_again_is_a_no_op():
    register()
    loader = WeightTransferEngineFactory._registry[BACKEND]
    register()
    assert WeightTransferEngineFactory._registry[BACKEND] is loader
    assert loader() is DeltaSyncEngine


def test_another_engine_holding_the_name_is_refused(monkeypatch):
    class Impostor(WeightTransferEngine):  # type: ignore[misc]
        pass

    monkeypatch.setitem(WeightTransferEngineFactory._registry, BACKEND, lambda: Impostor)
    with pytest.raises(RuntimeError, match=r"already registered to .*Impostor"):
        register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is Impostor  # left as found


def test_an_empty_registry_gets_a_lazy_entry(monkeypatch):
    """Registered by module path: resolving imports `deltasync.vllm_ext.engine` by name."""
    monkeypatch.delitem(WeightTransferEngineFactory._registry, BACKEND, raising=False)
    register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is DeltaSyncEngine
