"""Model preparation and the AsyncGRPOConfig, with defaults for one GPU and for a CPU."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from trl.experimental.async_grpo import AsyncGRPOConfig

from . import defaults
from .defaults import BUILT
from .random_qwen3 import MARKER, PRESETS, Preset, build_tiny_qwen3

__all__ = [
    "BUILT_CHAT",
    "CPU_STALENESS",
    "build_config",
    "built_preset",
    "max_staleness",
    "prepare_model",
]

# How a built model's turns are rendered: with Qwen3's empty think block in the generation
# prompt. The template re-renders every earlier assistant turn with that block, so without it in
# the prompt a turn the model wrote no longer prefixes the next turn's prompt: TRL then keeps the
# whole tool call as context, untrained (25 tokens of drift a call), and GRPO could learn only
# the few tokens that end the rollout, never which call to make.
BUILT_CHAT = {"enable_thinking": False}
# On a CPU a group of an environment's rollouts reaches the trainer about three versions after
# it started: one version per group ahead of it in TRL's pipeline (see `build_config`). With 1,
# about 60 % of a 40-step MCP run's samples were generated and then dropped as stale, on the
# cores the trainer needs, and which groups survived was phase-locked to the dataset's task
# rotation, so the groups trained were a biased sample. The sanity task keeps 1: its one-turn
# rollouts cost little to drop, and the fresher samples make the tiny demo learn faster.
CPU_STALENESS = 3


def prepare_model(model: str, model_dir: str, *, seed: int = 0) -> str:
    """The model string both the trainer and the rollout servers use.

    For a preset of `trainer.random_qwen3` ('tiny', 'small'), a random Qwen3 with a byte-level
    tokenizer is written to `model_dir` (once per preset and seed) with TRL's Qwen3 chat
    template, so tool calls parse; its absolute path is the served model name. Anything else is
    returned unchanged (a Hub id or a folder).
    """
    if model not in BUILT:
        return model
    from trl.chat_template_utils import qwen3_chat_template

    directory = Path(model_dir).resolve()
    built = _built(directory)
    if (built.get("seed"), built.get("preset")) != (seed, model):
        build_tiny_qwen3(directory, seed=seed, preset=model)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = qwen3_chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        (directory / "chat_template.jinja").unlink(missing_ok=True)
    # transformers writes the weights 0600 (earlier builds too); a replica in a container runs
    # as uid 1000 and reads them: as readable as the config beside them
    mode = (directory / "config.json").stat().st_mode & 0o777
    for weights in directory.glob("*.safetensors"):
        if weights.stat().st_mode & 0o777 != mode:
            with contextlib.suppress(PermissionError):  # another user's folder: left as it is
                weights.chmod(mode)
    return str(directory)


def build_config(
    args: argparse.Namespace, *, model: str, cpu: bool, vllm_url: str
) -> AsyncGRPOConfig:
    """TRL settings; a built preset gets its own learning rate and short completions so a few
    dozen steps show learning on a CPU (16 tokens for the sanity task, 64 for a tool call), a
    real model the RL defaults (lr 1e-6, 1024 tokens)."""
    preset = _preset(model)
    lr = args.lr if args.lr is not None else (preset.lr if preset else defaults.LR)
    built_length = defaults.BUILT_COMPLETION_LENGTH["sanity" if args.env == "sanity" else "tools"]
    length = args.max_completion_length or (
        built_length if preset else defaults.MAX_COMPLETION_LENGTH
    )
    return AsyncGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch_size,
        # A fixed number of samples per optimizer step. TRL's default token budget ignores the batch
        # size and packs a step with as many samples as fit in max_model_len unique tokens: with a
        # shared prompt prefix that was over 1000 samples (of short completions) per step.
        token_budget=0,
        max_completion_length=length,
        chat_template_kwargs=dict(BUILT_CHAT) if preset else None,
        max_tool_calling_iterations=args.max_tool_calls,
        vllm_server_base_url=vllm_url,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or defaults.SAVE_STEPS,
        seed=args.seed,
        use_cpu=cpu,
        gradient_checkpointing=not cpu,
        # On a CPU, vLLM generates faster than the trainer learns: keep TRL's pipeline short so
        # the trainer learns from recent policies (one group generating, one waiting to be scored:
        # `trainer.cpu.score_one_group_ahead`, one step's samples queued), and accept samples as
        # old as that pipeline is deep (`CPU_STALENESS`).
        max_inflight_tasks=args.num_generations if cpu else -1,
        queue_maxsize=args.batch_size if cpu else 1024,
        max_staleness=max_staleness(args, cpu),
        dtype="float32",
    )


def max_staleness(args: argparse.Namespace, cpu: bool) -> int:
    """TRL's `max_staleness`: how many versions a sample may lag the trainer's (`CPU_STALENESS`
    on a CPU, 1 for the sanity task there; `defaults.GPU_STALENESS` on a GPU). The trainer's
    rollout gate uses the same number (`trainer.routing.within_staleness`)."""
    if not cpu:
        return defaults.GPU_STALENESS
    return 1 if args.env == "sanity" else CPU_STALENESS


def built_preset(model: str) -> bool:
    """Whether `model` is a folder `prepare_model` built (a random model, no tool calling)."""
    return _preset(model) is not None


def _preset(model: str) -> Preset | None:
    """The preset a built model folder holds (None: not a built model)."""
    built = _built(Path(model))
    return PRESETS[built["preset"]] if built else None


def _built(directory: Path) -> dict:
    """A built model folder's marker (its preset and seed), {} for any other folder (one built
    before the marker had its name is built again)."""
    marker = directory / MARKER
    return json.loads(marker.read_text()) if marker.exists() else {}
