"""Change detection on the parameters' device: the same diffs as the host path, bit for bit.

The device code runs here on CPU tensors (`device="cpu"`): the same torch calls a GPU trainer
makes, compared with the host path's compiled scan.
"""

from __future__ import annotations

import pytest
import torch
from model_steps import AdamWLoop, tiny_qwen3
from safetensors.torch import load
from test_publisher import FlakyStore, _equal

from deltasync.errors import FormatError, PublishError
from deltasync.kernels.changes import Diff
from deltasync.publisher.device_snapshot import DeviceSnapshot, detection_device
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.manifest import read_manifest
from deltasync.wire.metadata import ParsedFile

CPU = torch.device("cpu")


def assert_same_diff(a: Diff, b: Diff) -> None:
    assert a.shapes == b.shapes
    assert a.digests == b.digests
    assert a.changes.keys() == b.changes.keys()
    for name, change in a.changes.items():
        other = b.changes[name]
        assert torch.equal(change.indices, other.indices), name
        assert change.indices.dtype == other.indices.dtype == torch.int64
        for field in ("values", "previous"):
            got, want = getattr(change, field), getattr(other, field)
            assert got.dtype == want.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (name, field)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_device_diffs_equal_the_host_path_with_versions_in_flight(lag):
    """`lag` versions stay in flight (handed out, not advanced) before each advance."""
    model = tiny_qwen3(seed=3)
    loop = AdamWLoop(model, lr=3e-4)
    host = Bf16Snapshot.capture(model)
    device = DeviceSnapshot(Bf16Snapshot.capture(model), CPU)
    pending: list[tuple[Diff, Diff]] = []
    changed = 0
    for _ in range(6):
        loop.step()
        want = host.diff(model, [h for h, _ in pending])
        got = device.diff(model, [d for _, d in pending])
        assert_same_diff(got, want)
        changed += got.changed_elements
        pending.append((want, got))
        while len(pending) > lag:
            h, d = pending.pop(0)
            host.advance(h)
            device.advance(d)
    assert changed > 0
    for name, tensor in host.tensors.items():
        assert torch.equal(device.tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_bf16_parameters_and_an_unchanged_step():
    model = tiny_qwen3(seed=1).to(torch.bfloat16)
    device = DeviceSnapshot(Bf16Snapshot.capture(model), CPU)
    assert device.diff(model).changes == {}
    device.advance(Diff({}, {}, {}))
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[7] = param.view(-1)[7] * 2 + 0.5
    diff = device.diff(model)
    assert list(diff.changes) == [name]
    assert diff.changes[name].indices.tolist() == [7]


def test_dropped_versions_rewind_the_device_reference_to_the_committed_state():
    model = tiny_qwen3(seed=2)
    loop = AdamWLoop(model, lr=3e-4)
    host = Bf16Snapshot.capture(model)
    device = DeviceSnapshot(Bf16Snapshot.capture(model), CPU)
    loop.step()
    device.diff(model)  # handed out, then dropped (its upload failed for good)
    loop.step()
    assert_same_diff(device.diff(model, []), host.diff(model, []))


def test_mismatched_models_are_refused():
    model = tiny_qwen3()
    device = DeviceSnapshot(Bf16Snapshot.capture(model), CPU)
    state = dict(model.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(FormatError, match="missing"):
        device.diff(state)
    state = dict(model.named_parameters())
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(FormatError, match="shape changed"):
        device.diff(state)


def test_where_detection_runs():
    model = tiny_qwen3()
    assert detection_device(model, "auto") is None  # CPU parameters: the host path
    assert detection_device(model, "host") is None
    assert detection_device(model, "device") == CPU
    with pytest.raises(ValueError, match="host, device or auto"):
        detection_device(model, "gpu")
    with pytest.raises(ValueError, match="host, device or auto"):
        PublisherConfig(run_id="run", change_detection="gpu")
    mixed = {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}
    with pytest.raises(FormatError, match="several devices"):
        detection_device(mixed, "auto")


def _publisher(store, **kw):
    return Publisher(store, PublisherConfig(run_id="run", change_detection="device", **kw))


def test_publisher_in_device_mode_publishes_what_the_host_mode_does(tmp_path):
    model = tiny_qwen3(seed=4)
    loop = AdamWLoop(model, lr=1e-3)
    stores = {m: LocalStore(tmp_path / m) for m in ("host", "device")}
    publishers = {
        m: Publisher(s, PublisherConfig(run_id="run", change_detection=m))
        for m, s in stores.items()
    }
    for _ in range(5):
        records = {m: p.publish(model).result(timeout=60) for m, p in publishers.items()}
        assert records["host"].changed_elements == records["device"].changed_elements
        loop.step()
    for p in publishers.values():
        p.close()
    files = {m: sorted(s.list("runs/run/deltas")) for m, s in stores.items()}
    assert len(files["host"]) == len(files["device"]) == 4
    for host_path, device_path in zip(files["host"], files["device"], strict=True):
        # safetensors orders the metadata map differently per write: compare what it holds
        host, device = (
            ParsedFile.parse(stores[m].get(p))
            for m, p in (("host", host_path), ("device", device_path))
        )
        assert host.meta == device.meta
        assert load(host.data).keys() == load(device.data).keys()
        for key, tensor in load(host.data).items():
            assert torch.equal(tensor, load(device.data)[key]), key


def test_device_mode_survives_a_failed_version_and_versions_in_flight(tmp_path):
    store = FlakyStore(tmp_path, attempts=2)
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    publisher = _publisher(store, queue_size=3)
    publisher.publish(model).result(timeout=30)
    store.gate.clear()  # versions 2 and 3 wait in flight: 3 is diffed against 2's reference
    futures = []
    for _ in range(2):
        loop.step()
        futures.append(publisher.publish(model))
    store.gate.set()
    assert [f.result(timeout=30).version for f in futures] == [2, 3]
    store.fail_always = True
    loop.step()
    with pytest.raises(PublishError, match="version 4"):
        publisher.publish(model).result(timeout=30)
    store.fail_always = False
    loop.step()
    with pytest.raises(PublishError):
        publisher.publish(model)
    assert publisher.publish(model).result(timeout=30).version == 4  # against committed 3
    publisher.close()
    replica = Replica()
    replica.sync(store)
    assert replica.version == 4 and _equal(replica, model)


def test_device_mode_resumes_a_run_from_the_bucket(tmp_path):
    store = LocalStore(tmp_path)
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    with _publisher(store) as publisher:
        publisher.publish(model).result(timeout=30)
        loop.step()
        publisher.publish(model).result(timeout=30)
    loop.step()
    with _publisher(store, takeover=True) as publisher:
        assert publisher.publish(model).result(timeout=30).version == 3
    assert read_manifest(store).latest_version == 3
    replica = Replica()
    replica.sync(store)
    assert _equal(replica, model)
