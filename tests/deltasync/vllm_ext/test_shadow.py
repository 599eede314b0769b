"""The shadow sink: the shadow is patched and verified first, then complete modules are reloaded."""

from __future__ import annotations

import pytest
import torch

from bench.models.vllm_layout import standin_layout
from deltasync.errors import DigestMismatch
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.vllm_ext.apply.shadow import ShadowSink
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import tiny_qwen3_config


class FakeModel:
    """Records what a reload receives; `fail` makes the next reload raise after recording."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[list[str], list[str]]] = []
        self.fail = False

    def reload(self, groups, modules):
        weights = sorted((w for group in groups.values() for w in group), key=lambda w: w[0])
        self.calls.append(([n for n, _ in weights], sorted(modules)))
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        if self.fail:
            self.fail = False
            raise RuntimeError("reload failed")


@pytest.fixture
def setup(tmp_path):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    trainer = Qwen3ForCausalLM(tiny_qwen3_config()).float()
    store = open_store(str(tmp_path / "bucket"))
    policy = AnchorPolicy(interval=100, max_delta_fraction=None)
    publisher = Publisher(store, PublisherConfig("run-s", policy=policy))
    fake = FakeModel()
    layout = standin_layout(trainer.config)
    yield trainer, store, publisher, fake, Replica(ShadowSink(fake.reload, layout))
    publisher.close()


def _update(replica, store, *paths):
    """Prepare (off the pause) and commit (the pause) the files at `paths`."""
    return replica.commit(replica.stage([(store.get(p), p) for p in paths]))


def test_touched_fused_groups_reload_whole(setup):
    trainer, store, publisher, fake, replica = setup
    anchor = publisher.publish(trainer).result(timeout=60)
    assert _update(replica, store, anchor.anchor_path) == [1]
    assert len(fake.calls[0][1]) == 2 * 8 + 2  # every module of the model
    params = dict(trainer.named_parameters())
    with torch.no_grad():
        params["model.layers.0.self_attn.k_proj.weight"][1] += 1.0
        params["model.layers.1.mlp.gate_proj.weight"][2] += 1.0
        params["model.embed_tokens.weight"][3] += 1.0
    delta = publisher.publish(trainer).result(timeout=60)
    assert _update(replica, store, delta.delta_path) == [2]
    names, modules = fake.calls[-1]
    assert modules == [
        "model.embed_tokens",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.mlp.gate_up_proj",
    ]
    assert sorted(names) == sorted(
        ["model.embed_tokens.weight"]
        + [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv"]
        + [f"model.layers.1.mlp.{m}_proj.weight" for m in ("gate", "up")]
    )
    expected = Bf16Snapshot.capture(trainer).tensors
    assert all(torch.equal(fake.loaded[n], expected[n]) for n in names)
    assert replica.digests() == Bf16Snapshot.capture(trainer).digests()


def test_catch_up_reloads_once_with_the_union(setup):
    trainer, store, publisher, fake, replica = setup
    paths = []
    for version in range(1, 5):
        if version > 1:
            with torch.no_grad():
                next(trainer.parameters())[version] += 1.0  # the embedding, one row per version
        record = publisher.publish(trainer).result(timeout=60)
        paths.append(record.delta_path or record.anchor_path)
    _update(replica, store, paths[0])
    fake.calls.clear()
    assert _update(replica, store, *paths[1:]) == [2, 3, 4]
    assert fake.calls == [(["model.embed_tokens.weight"], ["model.embed_tokens"])]
    assert replica.version == 4


def test_failed_reload_restores_shadow_and_model(setup):
    trainer, store, publisher, fake, replica = setup
    _update(replica, store, publisher.publish(trainer).result(60).anchor_path)
    before = replica.digests()
    with torch.no_grad():
        dict(trainer.named_parameters())["model.norm.weight"][0] = 3.0
    delta = publisher.publish(trainer).result(timeout=60)
    fake.fail = True
    with pytest.raises(RuntimeError, match="reload failed"):
        _update(replica, store, delta.delta_path)
    assert replica.version == 1 and replica.digests() == before
    assert fake.calls[-1][0] == ["model.norm.weight"]  # reloaded again, with the old values
    assert float(fake.loaded["model.norm.weight"][0]) == 1.0


def test_digest_mismatch_leaves_the_model_untouched(setup):
    trainer, store, publisher, fake, replica = setup
    _update(replica, store, publisher.publish(trainer).result(60).anchor_path)
    calls = len(fake.calls)
    with torch.no_grad():
        dict(trainer.named_parameters())["model.norm.weight"][0] = 3.0
    delta = publisher.publish(trainer).result(timeout=60)
    replica.tensors["model.norm.weight"][0] = 9.0  # the shadow drifted under the change
    with pytest.raises(DigestMismatch, match=r"model\.norm\.weight"):
        _update(replica, store, delta.delta_path)
    assert len(fake.calls) == calls  # nothing reloaded
    assert replica.version is None  # drifted: the next update reloads an anchor
    assert float(replica.tensors["model.norm.weight"][0]) == 9.0  # nothing written
