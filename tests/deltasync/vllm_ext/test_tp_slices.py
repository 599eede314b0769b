"""Tensor-parallel slices on the in-place (GPU) path, on stand-ins with vLLM's TP attributes: each
worker writes only its slice into its own parameter shard, bit for bit, padding never touched,
and the workers' digest shares verify every version."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deltasync.errors import FormatError
from deltasync.kernels.boxes import check_cover
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.vllm_ext.apply.layout import layout_from_writes, record_writes, with_owners
from deltasync.wire.digests import total
from deltasync.wire.manifest import fetch_entry, read_manifest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import tiny_qwen3_config

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
        self.config, self.rank, self.size = config, rank, size

    def load_weights(self, weights) -> None:
        """vLLM's TP loaders, as narrow-then-copy: q/k/v and gate/up rows of this rank into the
        fused shard, o/down columns, the vocabulary rows of `shard_indices`, norms whole."""
        params = dict(self.named_parameters())
        for name, loaded in weights:
            parts = name.split(".")
            member = parts[-2].removesuffix("_proj")
            if member in ("q", "k", "v", "gate", "up"):
                fused = "qkv_proj" if member in "qkv" else "gate_up_proj"
                module = self.get_submodule(".".join([*parts[:-2], fused]))
                param, shard = module.weight, ["q", "k", "v", "gate", "up"].index(member) % 3
                if fused == "qkv_proj":
                    hd = module.head_size
                    sizes = [
                        module.num_heads * hd,
                        module.num_kv_heads * hd,
                        module.num_kv_heads * hd,
                    ]
                    first = self.rank if shard == 0 else self.rank // module.num_kv_head_replicas
                else:
                    sizes, first = [s // self.size for s in module.output_sizes], self.rank
                source = loaded.narrow(0, first * sizes[shard], sizes[shard])
                param.data.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(source)
                continue
            param = params[name]
            module = self.get_submodule(name.rpartition(".")[0])
            if hasattr(module, "input_is_parallel"):
                width = module.input_size_per_partition
                param.data.copy_(loaded.narrow(1, self.rank * width, width))
            elif hasattr(module, "shard_indices"):
                start = module.shard_indices.org_vocab_start_index
                stop = module.shard_indices.org_vocab_end_index
                param.data[: stop - start].copy_(loaded.narrow(0, start, stop - start))
            else:
                param.data.copy_(loaded)


def _layout_of(standin: TpStandInQwen3):
    """The engine's layout for a stand-in worker: read off a meta twin's loaders, owners set."""
    with torch.device("meta"):
        twin = TpStandInQwen3(standin.config, standin.rank, standin.size)

    def layout(shapes):
        derived = layout_from_writes(*record_writes(twin, shapes), shapes)
        return with_owners(derived, standin, standin.rank, standin.size)

    return layout


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
        prepared.append(replica.stage([(fetch_entry(store, e), e.label) for e in plan]))
    combined = [total(list(s)) for s in zip(*(p.partials for p in prepared), strict=True)]
    return [r.commit(p, combined) for r, p in zip(replicas, prepared, strict=True)][-1]


def _assert_shards(standins, trainer) -> None:
    bf16 = Bf16Snapshot.capture(trainer).tensors
    for rank, standin in enumerate(standins):
        layout = _layout_of(standin)({n: tuple(t.shape) for n, t in bf16.items()}).exact()
        params = dict(standin.named_parameters(remove_duplicate=False))
        for name, placement in layout.items():
            flat = params[placement.param_name].data.view(-1)
            held = flat[placement.offset : placement.offset + placement.box.numel]
            expected = placement.box.take(bf16[name]).reshape(-1)
            assert torch.equal(held.view(torch.int16), expected.view(torch.int16)), (rank, name)
        embed = standin.model.embed_tokens.weight
        real = layout["model.embed_tokens.weight"].box
        assert bool((embed[real.rows[1] - real.rows[0] :] == SENTINEL).all())  # padding


def test_tp2_in_place_workers_hold_their_shards_bitwise(tmp_path):
    store = open_store(str(tmp_path / "bucket"))
    trainer = _trainer()
    config = tiny_qwen3_config(VOCAB)
    standins = [TpStandInQwen3(config, rank, 2) for rank in (0, 1)]
    replicas = [Replica(InPlaceSink(s, _layout_of(s), tp_rank=r)) for r, s in enumerate(standins)]
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


def test_a_checkpoint_that_does_not_split_is_refused_naming_it():
    """Gate rows 100 where the model splits 128 over two workers: the second worker's slice
    runs past the tensor (the first one's fits; the engine's exchange then fails both)."""
    layout = _layout_of(TpStandInQwen3(tiny_qwen3_config(VOCAB), 1, 2))
    gate = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(FormatError, match="refuses it") as info:
        layout({gate: (100, 64)}).exact()
    assert gate in str(info.value)
    with pytest.raises(FormatError, match="refuses it"):
        layout({"model.layers.0.mlp.w3.weight": (4, 4)}).exact()
