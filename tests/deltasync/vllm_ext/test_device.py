"""The in-place sink's own behaviour (layout, O(changed) writes, undo) on a fast stand-in.

The stand-in (`bench.models.vllm_layout`, which the GPU check uses too) has what the in-place path
relies on: `qkv_proj` / `gate_up_proj` parameters with `output_sizes`, an embedding padded to
64 rows, an LM head that shares the embedding's parameter, and a loader the layout is read off.
The chain rules and vLLM's own model classes are covered by `test_sink_conformance.py` and
`test_family_sinks.py`.
"""

from __future__ import annotations

import pytest
import torch

from bench.models.vllm_layout import SENTINEL, StandInQwen3, standin_layout
from deltasync.errors import DigestMismatch, FormatError
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.wire.digests import tensor_digest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import tiny_qwen3_config


def _trainer(vocab_size: int = 300, seed: int = 0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(vocab_size)).float()


def _step(model, lr: float, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _expected_fused(bf16: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    pre = f"model.layers.{layer}."
    qkv = torch.cat([bf16[f"{pre}self_attn.{m}_proj.weight"] for m in "qkv"])
    gate_up = torch.cat([bf16[f"{pre}mlp.{m}_proj.weight"] for m in ("gate", "up")])
    return qkv, gate_up


def _assert_served(standin: StandInQwen3, replica: Replica, trainer) -> None:
    bf16 = Bf16Snapshot.capture(trainer).tensors
    assert replica.digests() == {n: tensor_digest(t) for n, t in bf16.items()}
    for i, layer in enumerate(standin.model.layers):
        qkv, gate_up = _expected_fused(bf16, i)
        assert torch.equal(layer.self_attn.qkv_proj.weight.view(torch.int16), qkv.view(torch.int16))
        assert torch.equal(
            layer.mlp.gate_up_proj.weight.view(torch.int16), gate_up.view(torch.int16)
        )
    embed = standin.model.embed_tokens.weight
    vocab = trainer.config.vocab_size
    assert torch.equal(
        embed[:vocab].view(torch.int16), bf16["model.embed_tokens.weight"].view(torch.int16)
    )
    assert bool((embed[vocab:] == SENTINEL).all())  # padding rows never written
    assert standin.lm_head.weight is embed


@pytest.fixture
def bucket(tmp_path):
    return open_store(str(tmp_path / "bucket"))


def _publisher(store, encoding="packed", interval=4):
    policy = AnchorPolicy(interval=interval, max_delta_fraction=None)
    return Publisher(store, PublisherConfig("run-d", encoding=encoding, policy=policy))


def _apply(replica: Replica, store, path: str) -> bool:
    return replica.update(store.get(path), path=path)


def test_layout_read_off_the_loader_places_fused_shards():
    config = tiny_qwen3_config(300)
    shapes = {
        n: tuple(t.shape) for n, t in _trainer().state_dict().items() if n != "lm_head.weight"
    }
    layout = standin_layout(config)(shapes)
    placements = layout.exact()
    q, kv, inter, h = 64, 32, 128, 64
    k = placements["model.layers.1.self_attn.k_proj.weight"]
    v = placements["model.layers.1.self_attn.v_proj.weight"]
    up = placements["model.layers.0.mlp.up_proj.weight"]
    assert (k.param_name, k.offset, k.box.is_whole) == (
        "model.layers.1.self_attn.qkv_proj.weight",
        q * h,
        True,
    )
    assert v.offset == (q + kv) * h
    assert (up.param_name, up.offset) == ("model.layers.0.mlp.gate_up_proj.weight", inter * h)
    embed = placements["model.embed_tokens.weight"]
    assert (embed.param_name, embed.offset, embed.box.shape) == (
        "model.embed_tokens.weight",
        0,
        (300, h),
    )
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert layout.groups[qkv] == [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv"]
    assert layout.param_shapes[f"{qkv}.weight"] == (q + 2 * kv, h)


def test_layout_refuses_what_does_not_fit_naming_the_tensor():
    layout = standin_layout(tiny_qwen3_config(300))
    cases = {
        "model.layers.0.mlp.w3.weight": ((4, 4), "refuses it: KeyError"),
        "model.layers.0.self_attn.k_proj.weight": ((64, 64), "does not fit"),
        "model.embed_tokens.weight": ((400, 64), "does not fit"),
    }
    for name, (shape, why) in cases.items():
        with pytest.raises(FormatError, match=why) as info:
            layout({name: shape}).exact()
        assert name in str(info.value)


def test_delta_writes_only_the_changed_elements(bucket, monkeypatch):
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config)))
    with _publisher(bucket) as publisher:
        anchor = publisher.publish(trainer).result(timeout=60)
        _apply(replica, bucket, anchor.anchor_path)
        _step(trainer, 1e-3, 1)
        record = publisher.publish(trainer).result(timeout=60)
    staged = replica.stage([(bucket.get(record.delta_path), None)])
    written, copied = [], []
    index_copy, copy = torch.Tensor.index_copy_, torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "index_copy_",
        lambda t, d, i, s: written.append(i.numel()) or index_copy(t, d, i, s),
    )
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda t, *a, **k: copied.append(t.numel()) or copy(t, *a, **k)
    )
    replica.commit(staged)
    monkeypatch.undo()
    assert 0 < sum(written) == record.changed_elements < record.total_elements // 2
    assert copied == []  # no whole-tensor copies: O(changed elements)
    _assert_served(standin, replica, trainer)


def test_ctx_deltas_are_ranked_on_the_device_two_staged_at_once(bucket):
    """A `ctx` delta needs every base element's class: the sink computes classes and ranks
    where the parameters live, chunk by chunk (here 4096 elements), and copies only the changed
    values to the host; the second of two deltas staged together sees the first's new values."""
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config), chunk=4096))
    with _publisher(bucket, encoding="ctx", interval=8) as publisher:
        _apply(replica, bucket, publisher.publish(trainer).result(timeout=60).anchor_path)
        records = []
        for seed in (1, 2):
            _step(trainer, 1e-2, seed)
            records.append(publisher.publish(trainer).result(timeout=60))
    assert {r.encoding for r in records} == {"ctx"}
    copied = replica.sink.host_bytes
    staged = replica.stage([(bucket.get(r.delta_path), None) for r in records])
    assert replica.sink.host_bytes - copied <= 2 * 2 * sum(r.changed_elements for r in records)
    replica.commit(staged)
    assert replica.version == 3
    _assert_served(standin, replica, trainer)


def test_stage_changes_nothing_and_checks_digests(bucket):
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config)))
    with _publisher(bucket) as publisher:
        _apply(replica, bucket, publisher.publish(trainer).result(timeout=60).anchor_path)
        _step(trainer, 1e-2, 1)
        record = publisher.publish(trainer).result(timeout=60)
    before = {n: p.detach().clone() for n, p in standin.named_parameters()}
    data = bucket.get(record.delta_path)
    staged = replica.stage([(data, None)])
    assert all(torch.equal(before[n], p) for n, p in standin.named_parameters())
    # The served weights drifted from the file's base: refused before anything is written.
    name = "model.layers.1.self_attn.v_proj.weight"
    assert name in staged.files[0].decoded.changes
    views = replica.sink.views
    views[name].view(-1)[0] += 1.0  # writes into the fused qkv_proj parameter
    assert standin.model.layers[1].self_attn.qkv_proj.weight[96, 0] == views[name][0, 0]
    with pytest.raises(DigestMismatch, match="v_proj") as info:
        replica.stage([(data, None)])
    assert "without a delta" in str(info.value)
    assert replica.version is None  # it holds no known version: the next update reloads
    assert torch.equal(standin.model.layers[1].self_attn.qkv_proj.weight[96, 0], views[name][0, 0])


def test_failed_commit_undoes_the_deltas_already_written(bucket, monkeypatch):
    """The pause fails inside the third of three deltas: the two written are undone."""
    trainer, standin = _trainer(), StandInQwen3(tiny_qwen3_config(300))
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config)))
    paths = []
    with _publisher(bucket, interval=100) as publisher:
        for version in range(1, 5):
            if version > 1:
                _step(trainer, 1e-2, version)
            record = publisher.publish(trainer).result(timeout=60)
            paths.append(record.delta_path or record.anchor_path)
    _apply(replica, bucket, paths[0])
    before = {n: p.detach().clone() for n, p in standin.named_parameters()}
    prepared = replica.stage([(bucket.get(p), p) for p in paths[1:]])
    writes_per_delta = len(prepared.files[0].decoded.changes)
    calls = []
    index_copy = torch.Tensor.index_copy_

    def failing(t, d, i, s):
        calls.append(1)
        if len(calls) == 2 * writes_per_delta + 1:
            raise RuntimeError("device error (injected)")
        return index_copy(t, d, i, s)

    monkeypatch.setattr(torch.Tensor, "index_copy_", failing)
    with pytest.raises(RuntimeError, match="injected"):
        replica.commit(prepared)
    monkeypatch.undo()
    assert replica.version == 1
    assert all(torch.equal(before[n], p) for n, p in standin.named_parameters())
    assert replica.commit(prepared) == [2, 3, 4]
    _assert_served(standin, replica, trainer)


def test_first_anchor_that_does_not_fit_the_model_is_refused(bucket):
    trainer = _trainer()
    config = tiny_qwen3_config(300)
    config.intermediate_size = 256
    standin = StandInQwen3(config)
    before = {n: p.detach().clone() for n, p in standin.named_parameters()}
    replica = Replica(InPlaceSink(standin, standin_layout(standin.config)))
    with _publisher(bucket) as publisher:
        anchor = publisher.publish(trainer).result(timeout=60).anchor_path
    with pytest.raises(FormatError, match="does not fit"):
        replica.stage([(bucket.get(anchor), None)])
    assert replica.version is None
    assert all(torch.equal(before[n], p) for n, p in standin.named_parameters())
