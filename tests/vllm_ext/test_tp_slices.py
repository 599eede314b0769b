"""Tensor-parallel slices on the in-place (GPU) path, on stand-ins with vLLM's TP attributes: each
worker writes only its slice into its own parameter shard, bit for bit, padding never touched,
and the workers' digest shares verify every version."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deltasync.errors import FormatError
from deltasync.manifest import fetch_entry, read_manifest
from deltasync.policy import AnchorPolicy
from deltasync.publisher import Publisher, PublisherConfig
from deltasync.replica import Replica
from deltasync.slices import check_cover
from deltasync.snapshot import Bf16Snapshot
from deltasync.state_digest import total
from deltasync.state_hash import full_state_digest
from deltasync.store import open_store
from deltasync.vllm_ext.device import InPlaceSink
from deltasync.vllm_ext.layout import tp_layout
from trainer.tiny_model import tiny_qwen3_config

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
SENTINEL = -7.0
VOCAB = 300  # padded to 320 by vLLM: rank 0 holds rows 0..160, rank 1 rows 160..300 + padding


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.full(shape, SENTINEL, dtype=torch.bfloat16), requires_grad=False)


def _layer(weight: nn.Parameter, rank: int, size: int, **attrs) -> nn.Module:
    module = nn.Module()
    module.weight = weight
    module.tp_rank, module.tp_size = rank, size
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _norm(rows: int) -> nn.Module:
    module = nn.Module()
    module.weight = _param(rows)
    return module


class TpStandInQwen3(nn.Module):
    """Rank `rank` of `size` of vLLM's TP-sharded Qwen3 parameters (weights set to SENTINEL)."""

    packed_modules_mapping = PACKED

    def __init__(self, config, rank: int, size: int):
        super().__init__()
        h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        nq = heads // size
        replicas = max(1, size // kv_heads)
        nkv = max(1, kv_heads // size)
        per_rank = -(-config.vocab_size // 64) * 64 // size
        start = min(rank * per_rank, config.vocab_size)
        stop = min((rank + 1) * per_rank, config.vocab_size)
        shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=stop)
        self.model = nn.Module()
        self.model.embed_tokens = _layer(_param(per_rank, h), rank, size, shard_indices=shard)
        self.model.layers = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = _layer(
                _param((nq + 2 * nkv) * hd, h),
                rank,
                size,
                num_heads=nq,
                num_kv_heads=nkv,
                head_size=hd,
                num_kv_head_replicas=replicas,
                output_sizes=[nq * hd * size, nkv * hd * size, nkv * hd * size],
            )
            q = heads * hd
            layer.self_attn.o_proj = _layer(
                _param(h, q // size),
                rank,
                size,
                input_is_parallel=True,
                input_size_per_partition=q // size,
            )
            layer.self_attn.q_norm = _norm(hd)
            layer.self_attn.k_norm = _norm(hd)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = _layer(
                _param(2 * inter // size, h), rank, size, output_sizes=[inter, inter]
            )
            layer.mlp.down_proj = _layer(
                _param(h, inter // size),
                rank,
                size,
                input_is_parallel=True,
                input_size_per_partition=inter // size,
            )
            layer.input_layernorm = _norm(h)
            layer.post_attention_layernorm = _norm(h)
            self.model.layers.append(layer)
        self.model.norm = _norm(h)
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight  # tied


def _trainer(seed: int = 0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(VOCAB)).float()


def _step(model, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sync(replicas: list[Replica], store) -> list[int]:
    manifest = read_manifest(store)
    prepared = []
    for replica in replicas:
        plan = manifest.plan(replica.run_id, replica.version)
        prepared.append(replica.prepare([(fetch_entry(store, e), e.label) for e in plan]))
    combined = [total(list(s)) for s in zip(*(p.partials for p in prepared), strict=True)]
    return [r.commit(p, combined) for r, p in zip(replicas, prepared, strict=True)][-1]


def _assert_shards(standins, trainer) -> None:
    bf16 = Bf16Snapshot.capture(trainer).tensors
    for rank, standin in enumerate(standins):
        layout = tp_layout(standin, {n: tuple(t.shape) for n, t in bf16.items()}, PACKED, rank)
        params = dict(standin.named_parameters(remove_duplicate=False))
        for name, slot in layout.items():
            data = params[slot.param_name].data
            rows = slot.box.rows[1] - slot.box.rows[0]
            held = data[slot.row_offset : slot.row_offset + rows] if data.dim() else data
            expected = slot.box.take(bf16[name])
            assert torch.equal(held.view(torch.int16), expected.view(torch.int16)), (rank, name)
        embed = standin.model.embed_tokens.weight
        real = layout["model.embed_tokens.weight"].box
        assert bool((embed[real.rows[1] - real.rows[0] :] == SENTINEL).all())  # padding


def test_tp2_in_place_workers_hold_their_shards_bitwise(tmp_path):
    store = open_store(str(tmp_path / "bucket"))
    trainer = _trainer()
    config = tiny_qwen3_config(VOCAB)
    standins = [TpStandInQwen3(config, rank, 2) for rank in (0, 1)]
    replicas = [Replica(InPlaceSink(s, None, tp_rank=r)) for r, s in enumerate(standins)]
    policy = AnchorPolicy(interval=3, max_delta_fraction=None)
    publisher = Publisher(store, PublisherConfig("run-tp", policy=policy))
    for version in range(1, 6):
        if version > 1:
            _step(trainer, version)
        publisher.publish(trainer).result(timeout=60)
        assert _sync(replicas, store) == [version]
        _assert_shards(standins, trainer)
        expected = full_state_digest(Bf16Snapshot.capture(trainer).tensors)
        assert [r.state_digest for r in replicas] == [expected, expected]
    publisher.close()
    shapes = replicas[0].sink.shapes()
    check_cover([r.sink.boxes(shapes) for r in replicas], shapes)
    # the replicated KV heads: both workers hold them, only rank 0 counts them
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [r.sink.boxes(shapes)[k].owner for r in replicas] == [True, False]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert replicas[1].sink.boxes(shapes)[o].cols == (32, 64)


def test_a_checkpoint_that_does_not_split_is_refused():
    standin = TpStandInQwen3(tiny_qwen3_config(VOCAB), 0, 2)
    with pytest.raises(FormatError, match="splits"):
        tp_layout(standin, {"model.layers.0.mlp.gate_proj.weight": (100, 64)}, PACKED, 0)
    with pytest.raises(FormatError, match="no parameter"):
        tp_layout(standin, {"model.layers.0.mlp.w3.weight": (4, 4)}, PACKED, 0)
