"""Change detection on the parameters' device: the same diffs as the host path, bit for bit.

The device code runs here on CPU tensors (`device="cpu"`): the same torch calls a GPU trainer
makes, compared with the host path's compiled scan.
"""

from __future__ import annotations

import functools
import logging
import threading

import pytest
import torch
from model_steps import AdamWLoop
from safetensors.torch import load
from test_publisher import FlakyStore, _equal

from bench.host_waits import HostWaits
from bench.models.qwen3 import tiny_qwen3
from deltasync.errors import FormatError, PublishError
from deltasync.kernels.changes import Diff
from deltasync.publisher import publisher as publisher_module
from deltasync.publisher.device_snapshot import (
    TRANSIENT_BYTES,
    DeviceSnapshot,
    detection_device,
    device_bytes_needed,
    normalize_device,
)
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


def test_devices_are_normalised_to_the_current_index(monkeypatch):
    """`cuda` is the current CUDA device, which tensors report as `cuda:<index>`."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)  # no GPU needed
    assert normalize_device("cuda") == torch.device("cuda", 2)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device("cpu") == CPU


def test_a_snapshot_for_cuda_compares_equal_to_tensors_on_cuda_0(monkeypatch):
    """bench/gpu.py passes `torch.device("cuda")`; the parameters report `cuda:0`."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # no GPU needed
    device = DeviceSnapshot(Bf16Snapshot({}), torch.device("cuda"))
    assert device.device == torch.device("cuda", 0)


def _random_steps(generator: torch.Generator, state: dict[str, torch.Tensor], borders: list[int]):
    """Change a few % of each tensor in place, always the elements around window borders, some
    by less than a bf16 step (no change), some to special values."""
    for tensor in state.values():
        flat = tensor.view(-1)
        n = flat.numel()
        picked = torch.randint(0, n, (max(1, n // 30),), generator=generator)
        at = torch.cat([picked, torch.tensor([i for i in borders if i < n], dtype=torch.int64)])
        flat[at] += torch.randn(at.numel(), generator=generator)
        flat[picked[:3]] *= 1 + 2**-12  # below bf16's resolution: unchanged bits
        special = picked[-5:]
        flat[special] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40])[
            : special.numel()
        ]


@pytest.mark.parametrize("lag", [0, 2])
def test_windowed_detection_equals_the_host_path_over_random_states(lag, monkeypatch):
    """Windows of 1000 over tensors of 5000 (and odd sizes; the last window spans two
    tensors), changes at every window border, versions in flight: the same diffs, bit for bit,
    and no window longer than asked."""
    generator = torch.Generator().manual_seed(lag)
    state = {
        "flat": torch.randn(5000, generator=generator),
        "matrix": torch.randn(50, 100, generator=generator),
        "odd": torch.randn(2501, generator=generator),
        "small": torch.randn(7, generator=generator),
    }
    borders = [b + d for b in range(0, 5001, 1000) for d in (-1, 0, 1) if b + d >= 0]
    lengths: list[int] = []
    windows = DeviceSnapshot._windows

    def recorded(self, tensors):
        for start, new in windows(self, tensors):
            lengths.append(new.numel())
            yield start, new

    monkeypatch.setattr(DeviceSnapshot, "_windows", recorded)
    host = Bf16Snapshot.capture(state)
    device = DeviceSnapshot(Bf16Snapshot.capture(state), CPU, window=1000)
    pending: list[tuple[Diff, Diff]] = []
    seen: set[int] = set()
    for _ in range(8):
        _random_steps(generator, state, borders)
        want = host.diff(state, [h for h, _ in pending])
        got = device.diff(state, [d for _, d in pending])
        assert_same_diff(got, want)
        seen.update(got.changes["flat"].indices.tolist())
        pending.append((want, got))
        while len(pending) > lag:
            h, d = pending.pop(0)
            host.advance(h)
            device.advance(d)
    assert max(lengths) == 1000 and lengths[-1] == 12508 % 1000  # 'odd' and 'small' together
    assert {b for b in borders if b < 5000} <= seen
    for name, tensor in host.tensors.items():
        assert torch.equal(device.tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_at_most_6_bytes_per_changed_element_reach_the_host():
    """An int32 window index and the bf16 value (and each window's count, int64); the previous
    value is read on the host."""
    crossed: list[torch.Tensor] = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        crossed.append(tensor)
        return tensor.to("cpu", copy=True)

    model = tiny_qwen3(seed=5)
    loop = AdamWLoop(model, lr=3e-4)
    host = Bf16Snapshot.capture(model)
    device = DeviceSnapshot(Bf16Snapshot.capture(model), CPU, window=4096, to_host=to_host)
    for _ in range(3):
        loop.step()
        crossed.clear()
        want, got = host.diff(model), device.diff(model)
        assert_same_diff(got, want)
        assert got.changed_elements > 0
        counts, found, values = crossed
        windows = -(-sum(t.numel() for t in host.tensors.values()) // 4096)
        assert (counts.dtype, counts.numel()) == (torch.int64, windows)
        assert (found.dtype, values.dtype) == (torch.int32, torch.bfloat16)
        assert found.numel() == values.numel() == got.changed_elements
        host.advance(want)
        device.advance(got)


def _meta(*sizes: int) -> dict[str, torch.Tensor]:
    """Parameters on no CPU, whose sizes are all `auto` reads: a stand-in for a GPU's."""
    return {f"p{i}": torch.empty(n, device="meta") for i, n in enumerate(sizes)}


def test_auto_falls_back_to_the_host_when_device_memory_is_short_and_says_why(caplog):
    source = _meta(5000, 3000)
    need = device_bytes_needed([5000, 3000], window=1000)
    assert need == 2 * 8000 + TRANSIENT_BYTES * 1000
    meta = torch.device("meta")
    caplog.set_level(logging.INFO, logger="deltasync.publisher.device_snapshot")
    assert detection_device(source, "auto", free_bytes=lambda d: need - 1, window=1000) is None
    assert detection_device(source, "auto", free_bytes=lambda d: need, window=1000) == meta
    assert detection_device(source, "auto", free_bytes=lambda d: None, window=1000) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(r.levelno == logging.INFO for r in caplog.records)
    assert lines[0].startswith("change detection: host (auto: device detection needs")
    assert lines[1].startswith("change detection: device on meta (auto:")
    assert "unknown" in lines[2]
    # asked for explicitly: taken as asked, whatever the memory
    assert detection_device(source, "device", free_bytes=lambda d: 0) == meta
    assert detection_device(_meta(10), "host", free_bytes=lambda d: 10**12) is None


def test_the_publisher_chooses_and_logs_its_detection_once(tmp_path, monkeypatch, caplog):
    """In host mode too: an `auto` that changed its mind with versions in flight cannot rewind."""
    calls = []

    def counted(source, mode):
        calls.append(mode)
        return detection_device(source, mode)

    monkeypatch.setattr(publisher_module, "detection_device", counted)
    caplog.set_level(logging.INFO, logger="deltasync.publisher.device_snapshot")
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=1e-3)
    with Publisher(LocalStore(tmp_path), PublisherConfig(run_id="run")) as publisher:
        for _ in range(3):
            publisher.publish(model).result(timeout=30)
            loop.step()
    assert calls == ["auto"]
    assert [r.getMessage() for r in caplog.records if "change detection" in r.getMessage()] == [
        "change detection: host (auto: the parameters are on the CPU)"
    ]


def _copying(crossed: list[torch.Tensor]):
    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        crossed.append(tensor)
        return tensor.to("cpu", copy=True)

    return to_host


@pytest.mark.parametrize("density", [0.0, 1e-4, 0.02, 0.3, 1.0])
def test_a_diff_waits_on_the_device_at_most_4_times_at_any_size_and_density(density):
    """Tensors of many sizes in windows of 1000 (about 60 windows, most spanning tensors):
    one copy of the windows' counts and two of the changes, nothing else that waits; the
    same diff as the host path, bit for bit."""
    generator = torch.Generator().manual_seed(int(density * 1000))
    sizes = [7, 1, 4096, 300, 2**14, 999, 1001, 3, 25_000, 12]
    state = {f"t{i}": torch.randn(n, generator=generator) for i, n in enumerate(sizes)}
    crossed: list[torch.Tensor] = []
    host = Bf16Snapshot.capture(state)
    device = DeviceSnapshot(
        Bf16Snapshot.capture(state), CPU, window=1000, to_host=_copying(crossed)
    )
    for _ in range(2):
        for tensor in state.values():
            moved = torch.rand(tensor.shape, generator=generator) < density
            tensor[moved] += 1.0
        want = host.diff(state)
        crossed.clear()
        with HostWaits() as waits:
            got = device.diff(state, digests=False)
        assert waits.count + len(crossed) <= 4, (waits.count, len(crossed))
        assert_same_diff(got, Diff(want.changes, {}, want.shapes))
        host.advance(want)
        device.advance(got)


def test_real_adamw_steps_wait_a_constant_number_of_times():
    crossed: list[torch.Tensor] = []
    model = tiny_qwen3(seed=7)
    loop = AdamWLoop(model, lr=3e-4)
    host = Bf16Snapshot.capture(model)
    device = DeviceSnapshot(
        Bf16Snapshot.capture(model), CPU, window=2048, to_host=_copying(crossed)
    )
    for _ in range(3):
        loop.step()
        want = host.diff(model)
        crossed.clear()
        with HostWaits() as waits:
            got = device.diff(model, digests=False)
        assert waits.count + len(crossed) == 3
        assert_same_diff(got, Diff(want.changes, {}, want.shapes))
        host.advance(want)
        device.advance(got)


def test_a_step_over_the_buffer_budget_is_compared_window_by_window_and_says_so(caplog):
    """6 bytes a changed element over `compact_bytes`: the windowed compare, the same diff."""
    generator = torch.Generator().manual_seed(11)
    state = {"a": torch.randn(5000, generator=generator), "b": torch.randn(3, 700)}
    host = Bf16Snapshot.capture(state)
    device = DeviceSnapshot(Bf16Snapshot.capture(state), CPU, window=1000, compact_bytes=6 * 100)
    caplog.set_level(logging.INFO, logger="deltasync.publisher.device_snapshot")
    for moved in (50, 3000, 60):  # under, over, under the budget of 100 changed elements
        state["a"][torch.randperm(5000, generator=generator)[:moved]] += 1.0
        want, got = host.diff(state), device.diff(state)
        assert_same_diff(got, want)
        host.advance(want)
        device.advance(got)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "3000 changed elements" in lines[0]
    assert "window by window" in lines[0]


def test_the_changes_reach_the_host_in_the_publishers_thread(tmp_path, monkeypatch):
    """`publish` waits for the compare and the windows' counts only: the changes' copy to the
    host (on CUDA: pinned memory, a stream of its own) and their split run in the publisher's
    worker; the versions it commits are the host mode's."""
    crossed: list[tuple[bool, torch.dtype]] = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        crossed.append((threading.current_thread() is threading.main_thread(), tensor.dtype))
        return tensor.to("cpu", copy=True)

    snapshot = functools.partial(DeviceSnapshot, to_host=to_host)
    monkeypatch.setattr(publisher_module, "DeviceSnapshot", snapshot)
    model = tiny_qwen3(seed=9)
    loop = AdamWLoop(model, lr=3e-4)
    host = Bf16Snapshot.capture(model)
    with _publisher(LocalStore(tmp_path)) as publisher:
        publisher.publish(model).result(timeout=60)
        for _ in range(2):
            loop.step()
            want = host.diff(model)
            record = publisher.publish(model).result(timeout=60)
            assert record.changed_elements == want.changed_elements > 0
            host.advance(want)
    in_worker = [(False, torch.int32), (False, torch.bfloat16)]
    assert crossed == [(True, torch.int64), *in_worker] * 2


def test_the_buffer_of_changes_grows_with_the_steps_and_stays_within_its_budget():
    generator = torch.Generator().manual_seed(13)
    state = {"a": torch.randn(4000, generator=generator), "b": torch.randn(2000)}
    budget = 6 * 1000
    device = DeviceSnapshot(Bf16Snapshot.capture(state), CPU, window=512, compact_bytes=budget)
    sizes = []
    for moved in (10, 300, 900, 1000, 200):
        state["a"][torch.randperm(4000, generator=generator)[:moved]] += 1.0
        device.advance(device.diff(state, digests=False))
        sizes.append(device.buffer_bytes // 6)
        assert device.buffer_bytes <= budget
    assert sizes == sorted(sizes) and sizes[0] >= 10 and sizes[-1] == 1000
