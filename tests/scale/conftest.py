"""One sharded run (torchrun, 2 FSDP2 ranks) shared by the scale tests: its bucket, the ranks'
gathered bf16 state per version, and a model folder of the same shape for vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fsdp_runs import INTERMEDIATE, SCRIPT, VOCAB, torchrun


@pytest.fixture(scope="session")
def sharded_run(tmp_path_factory) -> Path:
    """`bucket/` (11 versions: the initial weights and 10 steps, `ctx` deltas) and
    `exp/<version>.safetensors`. (The MoE run below writes `ans` deltas.)"""
    root = tmp_path_factory.mktemp("fsdp")
    torchrun(
        "--bucket", str(root / "bucket"), "--steps", "10", "--expected", str(root / "exp"),
        "--encoding", "ctx",
    )  # fmt: skip
    return root


@pytest.fixture(scope="session")
def sharded_model_dir(tmp_path_factory) -> Path:
    """Config and tokenizer of the sharded run's model shape (weights come from the bucket)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from bench.models.qwen3 import uneven_qwen3
    from trainer.random_qwen3 import byte_level_tokenizer

    directory = tmp_path_factory.mktemp("model")
    uneven_qwen3(VOCAB, INTERMEDIATE, seed=0).bfloat16().save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def sharded_moe_run(tmp_path_factory) -> Path:
    """A Qwen3-MoE trained by two FSDP2 ranks (each holding half of every expert tensor):
    `bucket/` (6 versions), `exp/<version>.safetensors` (checkpoint names) and `model/` (config
    and tokenizer for vLLM)."""
    from bench.models.families import build_family

    root = tmp_path_factory.mktemp("fsdp-moe")
    torchrun(
        "--family", "qwen3-moe", "--bucket", str(root / "bucket"), "--steps", "5",
        "--expected", str(root / "exp"),
    )  # fmt: skip
    build_family("qwen3-moe", root / "model")
    return root
