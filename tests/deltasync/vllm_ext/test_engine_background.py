"""The engine's digest share runs off the worker's busy loop, and vLLM's sleep tells the engine
whether the weights survive (issue 30, findings 7 and 8); its staging reads a named delta beside
the manifest and plans a follower's version from the bytes its poll read (issue 31).

The engine is the one a worker builds (vLLM's own `VllmConfig`), its sink the in-place GPU sink
over a stand-in of vLLM's Qwen3 parameters, fed from a real bucket. The sleep goes through
vLLM's own worker wrapper: its `init_worker` mixes the extension into a worker class, and the
executor's `run_method` calls `sleep` on it as `collective_rpc` does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_in_process import _restored_environ, vllm_config_for

from bench.models.families import build_family
from bench.models.vllm_layout import StandInQwen3, standin_layout
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import open_store
from deltasync.store.latency import LatencyStore
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.vllm_ext.client import ReplicaClient, ReplicaError
from deltasync.vllm_ext.server.control import ControlConfig, ControlError, ControlPlane
from deltasync.wire.manifest import MANIFEST_PATH, read_manifest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import tiny_qwen3_config

EXTENSION = "deltasync.vllm_ext.worker.DeltaSyncWorkerExtension"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_family("llama", directory)
    return directory


def _trainer():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config(300)).float()


def _step(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)


@pytest.fixture
def served(model_dir, tmp_path):
    """(engine at the first version, bucket, the record of each of three versions): the
    second and third are published deltas the engine has not applied."""
    from vllm.config import WeightTransferConfig

    from deltasync.vllm_ext.engine import DeltaSyncEngine

    with _restored_environ():
        config = vllm_config_for(model_dir)
    standin = StandInQwen3(tiny_qwen3_config(300))
    engine = DeltaSyncEngine(
        WeightTransferConfig(backend="deltasync"), config, torch.device("cpu"), standin
    )
    engine._make_sink = lambda: InPlaceSink(standin, standin_layout(standin.config))
    store = open_store(str(tmp_path / "bucket"))
    trainer, records = _trainer(), []
    policy = AnchorPolicy(interval=8, max_delta_fraction=None)
    with Publisher(store, PublisherConfig("run-s", policy=policy)) as publisher:
        for seed in range(3):
            records.append(publisher.publish(trainer).result(timeout=60))
            _step(trainer, seed + 1)
    engine.init_transfer_engine(engine.parse_init_info({"bucket": store.url}))
    engine.update_weights({"version": records[0].version})
    yield engine, store, records
    engine.shutdown()


def _promised(store, version: int) -> str:
    return read_manifest(store).version_digest(version)


def _share_when_done(engine, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (answer := engine.state_share())["pending"]:
        assert time.monotonic() < deadline, answer
        time.sleep(0.02)
    return answer


def _blocked_pass(engine, monkeypatch) -> tuple[threading.Event, list[str]]:
    """The sink's digest pass waits for the returned event; the threads it ran on are listed."""
    gate, threads = threading.Event(), []
    sums = engine.state.sink.state_sums

    def state_sums():
        threads.append(threading.current_thread().name)
        assert gate.wait(60)
        return sums()

    monkeypatch.setattr(engine.state.sink, "state_sums", state_sums)
    return gate, threads


# -- the share pass, off the busy loop ---------------------------------------------------------


def test_share_is_computed_on_the_staging_thread_and_the_call_returns_at_once(served, monkeypatch):
    engine, store, records = served
    gate, threads = _blocked_pass(engine, monkeypatch)
    release = threading.Timer(5.0, gate.set)  # old code: frees the inline pass, then fails
    release.start()
    started = time.perf_counter()
    answer = engine.state_share()  # no pass yet for the version held: this starts one
    assert time.perf_counter() - started < 1.0  # the worker's busy loop was not held
    held = {"run_id": "run-s", "version": records[0].version}
    assert answer == held | {"share": None, "pending": True}
    assert engine.status()["busy"]  # the sync route pauses only once it is done
    release.cancel()
    gate.set()
    answer = _share_when_done(engine)
    assert answer["version"] == records[0].version and not answer["pending"]
    assert answer["share"] == _promised(store, records[0].version)
    assert len(threads) == 1 and threads[0].startswith("deltasync-stage")
    assert engine.state_share() == answer  # read again: no second pass
    assert len(threads) == 1
    engine.state_share(start=True)  # a fresh pass over what is served now
    assert _share_when_done(engine) == answer and len(threads) == 2


def test_an_update_waits_for_the_share_pass_then_the_share_follows_the_version(served, monkeypatch):
    """The pass reads the version it reports: the commit waits for it, and a pass over a
    version no longer held is never the answer."""
    engine, store, records = served
    engine.stage(records[1].version)
    engine.settle()  # staged: the update below commits it
    gate, _ = _blocked_pass(engine, monkeypatch)
    assert engine.state_share(start=True)["pending"]
    info = {"version": records[1].version}
    update = threading.Thread(target=engine.update_weights, args=(info,))
    update.start()
    update.join(0.5)
    assert update.is_alive() and engine.state.version == records[0].version  # not written
    gate.set()
    update.join(60)
    assert not update.is_alive() and engine.state.version == info["version"]
    assert engine.state_share()["pending"]  # the pass over the version before is no answer
    answer = _share_when_done(engine)
    assert answer["version"] == info["version"]
    assert answer["share"] == _promised(store, info["version"])


# -- staging: one manifest read, beside the named delta or none at all ---------------------------


def _kinds(calls) -> Counter:
    return Counter(f"{c.target}.{c.kind}" for c in calls)


def test_a_named_delta_is_staged_beside_the_manifest_read(served):
    engine, store, records = served
    engine.store = LatencyStore(store, latency_s=0.1, bandwidth=None)
    path = records[1].delta_path
    engine.stage(records[1].version, path)
    engine.settle()
    calls = engine.store.calls
    assert _kinds(calls) == {"manifest.get": 1, "delta.get": 1}
    manifest, delta = (next(c for c in calls if c.target == t) for t in ("manifest", "delta"))
    assert delta.started < manifest.at  # read at once: one round trip
    engine.update_weights({"version": records[1].version, "path": path})  # takes that staging
    assert engine.state.version == records[1].version and len(calls) == 2
    assert engine.status()["state_digest"] == _promised(store, records[1].version)


def test_a_followers_manifest_bytes_are_staged_from_not_read_again(served):
    engine, store, records = served
    engine.store = LatencyStore(store, latency_s=0, bandwidth=None)
    version = records[2].version
    engine.stage(version, None, b'{"protocol": "deltasync/5"}')  # checked as a read would be
    engine.settle()
    assert engine.status()["staging"][str(version)].startswith("failed: FormatError")
    engine.stage(version, None, store.get(MANIFEST_PATH))
    engine.settle()
    engine.update_weights({"version": version})
    assert engine.state.version == version
    assert _kinds(engine.store.calls) == {"delta.get": 2}  # deltas 2 and 3; no manifest read


# -- the client polls; the control plane lets `start` through --------------------------------


def test_client_starts_a_pass_then_polls_until_every_worker_has_its_share(monkeypatch):
    client = ReplicaClient("http://replica")
    shares = {"0": "00000001" * 4, "1": "00000002" * 4}
    calls: list[dict] = []

    def rpc_all(method, **kwargs):
        assert method == "deltasync_state_share"
        calls.append(kwargs)
        pending = len(calls) < 3
        held = {"run_id": "r", "version": 4, "pending": pending}
        return [held | {"share": None if pending else share} for share in shares.values()]

    monkeypatch.setattr(client, "rpc_all", rpc_all)
    version, digest = client.served_state_digest(poll_s=0.001)
    assert calls == [{"start": "1"}, {}, {}]
    assert version == 4 and digest.hex() == "00000003" * 4
    calls.clear()
    monkeypatch.setattr(client, "rpc_all", lambda method, **kw: [{"share": None, "pending": True}])
    with pytest.raises(ReplicaError, match="not ready after"):
        client.served_state_digest(timeout_s=0.05, poll_s=0.01)


def test_control_plane_passes_start_to_the_share_rpc_and_refuses_other_arguments():
    calls = []

    async def collective_rpc(method, kwargs=None, **_):
        calls.append((method, kwargs))
        return [{"share": None, "pending": True}]

    engine = SimpleNamespace(collective_rpc=collective_rpc)
    control = ControlPlane(ControlConfig())
    body = {"method": "deltasync_state_share", "kwargs": {"start": "1"}}
    assert asyncio.run(control.rpc(engine, body))["results"] == [{"share": None, "pending": True}]
    assert calls == [("deltasync_state_share", {"start": "1"})]
    for kwargs in ({"start": "yes"}, {"version": "1"}):
        with pytest.raises(ControlError) as info:
            asyncio.run(control.rpc(engine, {"method": "deltasync_state_share", "kwargs": kwargs}))
        assert info.value.status == 422
    assert len(calls) == 1


# -- sleep ---------------------------------------------------------------------------------------


class FakeWorker(CPUWorker):
    """vLLM's CPU worker class, built without a device: its `sleep` records the version the
    engine claimed when vLLM's own sleep ran (GPU workers discard or offload the weights)."""

    def __init__(self, vllm_config, engine) -> None:
        self.vllm_config = vllm_config
        self.weight_transfer_engine = engine
        self.slept: list[tuple[str, object, int | None]] = []

    def sleep(self, level: int = 1) -> None:
        self.slept.append(("sleep", level, self.weight_transfer_engine.state.version))

    def discard(self, tags: tuple[str, ...]) -> None:
        self.slept.append(("discard", tags, self.weight_transfer_engine.state.version))


def _worker(engine, monkeypatch):
    """A worker made as vLLM makes it (`WorkerWrapperBase.init_worker` mixes the extension in),
    less its process-wide set-up: plugins and the platform's kernel overrides."""
    import vllm.plugins
    from vllm.platforms import current_platform
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    monkeypatch.setattr(vllm.plugins, "load_general_plugins", lambda: None)
    monkeypatch.setattr(current_platform, "register_triton_kernel_overrides", lambda: None)

    config = engine.vllm_config
    config.parallel_config.worker_cls = f"{__name__}.FakeWorker"
    config.parallel_config.worker_extension_cls = EXTENSION
    wrapper = WorkerWrapperBase()
    with _restored_environ():
        wrapper.init_worker([{"vllm_config": config, "engine": engine}])
    return wrapper


def test_sleep_level_2_forgets_the_version_and_the_next_update_reloads_an_anchor(
    served, monkeypatch
):
    from vllm.v1.serial_utils import run_method

    engine, store, records = served
    wrapper = _worker(engine, monkeypatch)
    engine.stage(records[1].version)
    run_method(wrapper, "sleep", (), {"level": 2})
    assert wrapper.worker.slept == [("sleep", 2, None)]  # forgotten before vLLM discarded
    assert engine.status()["version"] is None and engine.status()["state_digest"] is None
    none = {"run_id": None, "version": None, "share": None, "pending": False}
    assert engine.state_share() == none
    engine.update_weights({"version": records[2].version})
    assert engine.last_update["applied"][0] == records[0].version  # replayed from the anchor
    assert engine.state.version == records[2].version
    assert _share_when_done(engine)["share"] == _promised(store, records[2].version)


def test_sleep_level_1_keeps_the_version_and_discarding_the_weights_forgets_it(served, monkeypatch):
    from vllm.v1.serial_utils import run_method

    engine, _, records = served
    wrapper = _worker(engine, monkeypatch)
    run_method(wrapper, "sleep", (), {"level": 1})
    assert wrapper.worker.slept == [("sleep", 1, records[0].version)]
    assert engine.status()["version"] == records[0].version
    run_method(wrapper, "discard", (("kv_cache",),), {})
    assert engine.status()["version"] == records[0].version
    run_method(wrapper, "discard", (("weights", "kv_cache"),), {})
    assert wrapper.worker.slept[-1] == ("discard", ("weights", "kv_cache"), None)
    assert engine.status()["version"] is None
