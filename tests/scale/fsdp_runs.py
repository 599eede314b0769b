"""Runs of `fsdp_train.py` under torchrun (2 ranks) for the scale tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scale" / "fsdp_train.py"
VOCAB, INTERMEDIATE = 509, 130  # odd vocabulary: uneven row shards and vLLM vocab padding


def torchrun(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free loopback port for the rendezvous
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        "--vocab",
        str(VOCAB),
        "--intermediate",
        str(INTERMEDIATE),
        *args,
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done
