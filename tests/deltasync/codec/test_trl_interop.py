"""`coo` files interoperate with TRL PR #5417 both ways; anchors load in transformers as is."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from model_steps import AdamWLoop, trl_v1_write
from safetensors import safe_open

from bench.models.qwen3 import tiny_qwen3
from deltasync.codec import encode_anchor, encode_delta
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica


def trl_v1_apply(path, snapshot: dict[str, torch.Tensor]) -> None:
    """An independent TRL-v1-style reader: safe_open, then scatter values at indices."""
    with safe_open(str(path), framework="pt") as f:
        meta, keys = f.metadata(), f.keys()
        assert meta["format"] == "sparse_weight_patch" and meta["sparse"] == "True"
        assert sorted(json.loads(meta["changed_params"])) == sorted(
            k[: -len(".indices")] for k in keys if k.endswith(".indices")
        )
        for key in keys:
            if key.endswith(".indices"):
                name = key[: -len(".indices")]
                indices = f.get_tensor(key).long()
                snapshot[name].view(-1)[indices] = f.get_tensor(f"{name}.values")


def _steps(n: int, lr: float = 1e-5):
    model = tiny_qwen3()
    loop = AdamWLoop(model, lr=lr)
    states = [Bf16Snapshot.capture(model).tensors]
    for _ in range(n):
        loop.step()
        states.append(Bf16Snapshot.capture(model).tensors)
    return states


def test_our_coo_files_are_read_by_a_trl_v1_reader(tmp_path):
    states = _steps(4)
    reader_state = {k: v.clone() for k, v in states[0].items()}
    snapshot = Bf16Snapshot({k: v.clone() for k, v in states[0].items()})
    for version, state in enumerate(states[1:], start=2):
        diff = snapshot.diff(state)
        path = tmp_path / f"step_{version:06d}.safetensors"
        path.write_bytes(
            encode_delta(
                diff,
                run_id="r",
                version=version,
                base_version=version - 1,
                state_digest=full_state_digest(state),
                encoding="coo",
            )
        )
        snapshot.advance(diff)
        trl_v1_apply(path, reader_state)
        for name, tensor in state.items():
            assert torch.equal(reader_state[name].view(torch.int16), tensor.view(torch.int16))


def test_trl_v1_files_are_applied_by_our_replica(tmp_path):
    states = _steps(4)
    replica = Replica(allow_legacy=True)
    replica.update(encode_anchor(states[0], run_id="r", version=1))
    for version, (base, new) in enumerate(itertools.pairwise(states), start=2):
        path = tmp_path / f"step_{version:06d}.safetensors"
        trl_v1_write(path, version, base, new)
        assert replica.update(path.read_bytes())
        assert replica.version == version
        for name, tensor in new.items():
            assert torch.equal(replica.tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_anchor_loads_in_transformers_as_is(tmp_path):
    model = tiny_qwen3()
    state = Bf16Snapshot.capture(model).tensors
    assert "lm_head.weight" not in state  # tied: HF checkpoints omit it
    model.config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(encode_anchor(state, run_id="r", version=1))
    from transformers import Qwen3ForCausalLM

    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    for name, tensor in state.items():
        assert torch.equal(params[name].view(torch.int16), tensor.view(torch.int16)), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("tie", [True, False])
def test_tied_alias_is_dropped_only_when_tied(tie):
    model = tiny_qwen3(tie=tie)
    names = Bf16Snapshot.capture(model.state_dict()).tensors.keys()
    assert ("lm_head.weight" in names) is not tie
