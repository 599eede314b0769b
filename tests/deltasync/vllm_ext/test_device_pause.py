"""The in-place sink on a serving device's terms, emulated on CPU (issue 30, findings 2, 4, 8).

The pause uploads changes in bounded chunks and refuses, writing nothing, when the device's free
memory (an injected budget here) cannot hold its largest chunk; a failure inside a tensor's
chunks is undone chunk by chunk; commits run under `inference_mode`, where vLLM creates its
parameters; staging a delta copies only the changed elements' values to the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

from bench.models.vllm_layout import StandInQwen3, standin_layout
from deltasync.errors import ReloadError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.wire.digests import tensor_digest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import tiny_qwen3_config

CHUNK = 64  # elements per upload in these tests: every touched tensor takes many chunks
CHUNK_BYTES = CHUNK * (8 + 2)  # an int64 index and a bf16 value per element


def _trainer():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config(300)).float()


def _nudge(trainer, stride: int, names: tuple[str, ...]) -> None:
    """A sparse step: every `stride`-th element of the named tensors moves."""
    params = dict(trainer.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].view(-1)[::stride] += 0.25


TOUCHED = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight")


@pytest.fixture
def bucket(tmp_path):
    return open_store(str(tmp_path / "bucket"))


def _publish(store, trainer, strides: list[int], encoding: str = "packed") -> list[str]:
    """An anchor, then one delta per stride; the files' paths."""
    policy = AnchorPolicy(interval=100, max_delta_fraction=None)
    paths = []
    with Publisher(store, PublisherConfig("run-p", encoding=encoding, policy=policy)) as pub:
        paths.append(pub.publish(trainer).result(timeout=60).anchor_path)
        for stride in strides:
            _nudge(trainer, stride, TOUCHED)
            paths.append(pub.publish(trainer).result(timeout=60).delta_path)
    return paths


def _expected(trainer) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in Bf16Snapshot.capture(trainer).tensors.items()}


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bitwise_equal(before: Mapping[str, torch.Tensor], model) -> bool:
    return all(
        torch.equal(before[n].view(torch.int16), p.detach().view(torch.int16))
        for n, p in model.named_parameters()
    )


def _chunks(indices: torch.Tensor) -> int:
    return -(-indices.numel() // CHUNK)


def _index_copies(monkeypatch, fail_at: int | None = None) -> list[int]:
    """The element count of every `index_copy_` (the sink's uploads); the `fail_at`-th raises."""
    sizes: list[int] = []
    index_copy = torch.Tensor.index_copy_

    def recording(t, dim, index, source):
        sizes.append(index.numel())
        if len(sizes) == fail_at:
            raise RuntimeError("device error (injected)")
        return index_copy(t, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", recording)
    return sizes


def test_commit_below_one_chunk_of_free_memory_is_refused_unchanged(bucket, monkeypatch):
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    budget = {"free": CHUNK_BYTES - 1}
    asked: list[torch.device] = []

    def free_bytes(device: torch.device) -> int:
        asked.append(device)
        return budget["free"]

    sink = InPlaceSink(standin, standin_layout(standin.config), chunk=CHUNK, free_bytes=free_bytes)
    replica = Replica(sink)
    anchor, delta = _publish(bucket, trainer, [7])
    replica.update(bucket.get(anchor), path=anchor)  # an anchor uploads no chunk: no check
    assert asked == []
    before = _params(standin)
    staged = replica.stage([(bucket.get(delta), delta)])
    sizes = _index_copies(monkeypatch)
    with pytest.raises(ReloadError, match=f"needs {CHUNK_BYTES} bytes on cpu") as info:
        replica.commit(staged)
    assert "\n" not in str(info.value) and "previous version keeps serving" in str(info.value)
    assert sizes == []  # nothing written
    assert _bitwise_equal(before, standin)
    assert replica.version == 1
    assert asked == [torch.device("cpu")]

    budget["free"] = CHUNK_BYTES
    assert replica.commit(staged) == [2]
    changed = sum(c.indices.numel() for c in staged.files[0].decoded.changes.values())
    assert sum(sizes) == changed and max(sizes) == CHUNK and len(sizes) > len(TOUCHED)
    assert replica.digests() == _expected(trainer)


def test_failure_inside_a_tensors_chunks_is_undone_chunk_by_chunk(bucket, monkeypatch):
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    sink = InPlaceSink(standin, standin_layout(standin.config), chunk=CHUNK)
    replica = Replica(sink)
    paths = _publish(bucket, trainer, [7, 5])
    replica.update(bucket.get(paths[0]), path=paths[0])
    before = _params(standin)
    staged = replica.stage([(bucket.get(p), p) for p in paths[1:]])
    chunks_before = sum(_chunks(c.indices) for c in staged.files[0].decoded.changes.values())
    first = _chunks(next(iter(staged.files[1].decoded.changes.values())).indices)
    assert first > 3
    # Fails at the third chunk of the second delta's first tensor: two of its chunks written.
    sizes = _index_copies(monkeypatch, fail_at=chunks_before + 3)
    with pytest.raises(RuntimeError, match="injected"):
        replica.commit(staged)
    monkeypatch.undo()
    # The undo went chunk by chunk over the first delta and the whole tensor written in part.
    assert len(sizes) == (chunks_before + 3) + (chunks_before + first)
    assert max(sizes) == CHUNK
    assert _bitwise_equal(before, standin)
    assert replica.version == 1
    assert replica.commit(staged) == [2, 3]
    assert replica.digests() == _expected(trainer)


@pytest.mark.parametrize("created", ["inference_mode", "requires_grad"])
def test_commits_write_parameters_vllm_creates_under_inference_mode(bucket, created):
    """vLLM creates its parameters under `inference_mode`: such tensors may be written in place
    only inside it. Parameters created normally (even leaves requiring grad) take it too."""
    trainer = _trainer()
    if created == "inference_mode":
        with torch.inference_mode():
            standin = StandInQwen3(tiny_qwen3_config(300))
        assert all(p.is_inference() for p in standin.parameters())
    else:
        standin = StandInQwen3(tiny_qwen3_config(300))
        for p in standin.parameters():
            p.requires_grad_(True)
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config)))
    paths = _publish(bucket, trainer, [7])
    for path in paths:
        assert replica.update(bucket.get(path), path=path)
    assert replica.version == 2
    assert replica.digests() == _expected(trainer)
    if created == "requires_grad":
        assert all(p.requires_grad and p.grad_fn is None for p in standin.parameters())


class _Counting(Mapping[str, torch.Tensor]):
    """The sink's host view of its parameters, counting the bytes of every tensor it hands the
    replica (whole copies or gathered values): what staging copied to the host."""

    def __init__(self, inner: Mapping[str, torch.Tensor], counted: list[int]):
        self._inner = inner
        self._counted = counted

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._inner[name]
        self._counted.append(tensor.nbytes)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._inner

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, attr: str):  # what else the sink's view offers (gather, shape_of)
        found = getattr(self._inner, attr)
        if attr != "gather":
            return found

        def gather(name: str, indices: torch.Tensor) -> torch.Tensor:
            values = found(name, indices)
            self._counted.append(values.nbytes)
            return values

        return gather


@pytest.mark.parametrize("encoding", ["ctx", "ans", "packed", "coo"])
def test_staging_deltas_copies_only_changed_values_to_the_host(bucket, monkeypatch, encoding):
    """Two sparse deltas staged at once (the second decodes against the first's result, at
    indices both change): bytes to the host are O(changed), not the touched tensors whole."""
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    sink = InPlaceSink(standin, standin_layout(standin.config))
    replica = Replica(sink)
    paths = _publish(bucket, trainer, [23, 31], encoding)
    replica.update(bucket.get(paths[0]), path=paths[0])
    counted: list[int] = []
    tensors = InPlaceSink.tensors
    monkeypatch.setattr(InPlaceSink, "tensors", lambda s: _Counting(tensors(s), counted))
    staged = replica.stage([(bucket.get(p), p) for p in paths[1:]])
    monkeypatch.undo()
    changed = sum(c.indices.numel() for f in staged.files for c in f.decoded.changes.values())
    whole = sum(v.nbytes for n, v in sink.views.items() if n in TOUCHED)
    assert changed > 0 and 16 * changed + 4096 < whole  # sparse enough to tell them apart
    assert sum(counted) <= 16 * changed + 4096, f"{sum(counted)} B to host, {changed} changed"
    assert sink.host_bytes == sum(counted)
    assert replica.commit(staged) == [2, 3]
    assert replica.digests() == _expected(trainer)
