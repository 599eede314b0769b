"""`python -m trainer.train`'s flags, in groups (`--help` shows them so); every default from
`trainer.defaults` (or `deltasync.defaults` for the wire's own)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from deltasync import settings
from deltasync.arguments import (
    bucket_url,
    count,
    folder,
    http_url,
    learning_rate,
    model_ref,
    positive,
    whole,
)
from deltasync.codec import ENCODINGS
from deltasync.defaults import ANCHOR_INTERVAL, ENCODING

from . import defaults
from .envs.spec import env_arg
from .envs.warmup import WARMUP_STEPS
from .tasks import DEFAULT_CHARS

__all__ = ["build_parser"]


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for title, add in (
        ("the model", _model_arguments),
        ("the bucket and the run", _bucket_arguments),
        ("the rollout replicas", _replicas_arguments),
        ("the environment", _environment_arguments),
        ("training", _training_arguments),
        ("the weight sync", _sync_arguments),
        ("output", _output_arguments),
    ):
        add(p.add_argument_group(title))
    return p


def _model_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--model",
        type=model_ref,
        default=defaults.MODEL,
        help=f"HF model id or folder; {defaults.SMALL!r} (1.6M parameters, the default) and "
        f"{defaults.TINY!r} (107k) build a random 2-layer Qwen3 offline",
    )
    p.add_argument(
        "--model-dir",
        default=defaults.MODEL_DIR,
        help="where a built model is written (and served from) (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")


def _bucket_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--bucket",
        type=bucket_url,
        default=defaults.BUCKET,
        help="folder, hf://buckets/NS/NAME, s3://... (default %(default)s)",
    )
    p.add_argument("--run-id", default=None, help="run name in the bucket (default: run-<time>)")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="continue the bucket's run of --run-id from its last committed version and weights "
        "(fresh optimizer); a trainer still publishing it fails its next commit (without this "
        "flag such a start is refused)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="like --takeover, but restore optimizer, scheduler and rollout position from the "
        "newest TRL checkpoint in --output-dir; refused unless its weights are the bucket's last "
        "committed version",
    )
    p.add_argument(
        "--save-steps",
        type=whole,
        default=0,
        help="save a TRL checkpoint every N steps and at the end, for --resume (default 0: none)",
    )


def _replicas_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--vllm-server-url",
        type=http_url,
        action="append",
        default=None,
        help=f"rollout server; repeat for several replicas (default {defaults.VLLM_URL}); "
        "weights go to all, rollouts to those up and within max_staleness of the freshest",
    )
    p.add_argument(
        "--follower-url",
        type=http_url,
        action="append",
        default=None,
        help="rollout server that follows the bucket itself (serve --follow, the Space "
        "default); repeat for several. The trainer never syncs it: it only reads the version "
        "it serves, for routing rollouts",
    )
    p.add_argument(
        "--replica-down-after",
        type=positive,
        default=None,
        metavar="SECONDS",
        help="stop the run once every rollout replica has failed /health this long (default: "
        f"{defaults.LOCAL_DOWN_AFTER_S:.0f} s on this machine, "
        f"{defaults.REMOTE_DOWN_AFTER_S:.0f} s when a replica is remote, e.g. a Space that "
        "restarts)",
    )
    p.add_argument(
        "--vllm-api-key",
        default=settings.API_KEY.read() or None,
        help=f"bearer token of the rollout servers (default ${settings.API_KEY.name})",
    )


def _environment_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--env",
        type=env_arg,
        default=defaults.ENV,
        help="sanity: reward = share of some tokens, no server; wordle: the Wordle server at "
        "--env-url; an OpenEnv server URL (or openenv: the one at --env-url), inspected: "
        "TextArena-shaped servers get an `act` tool, MCP-tool servers one tool per server "
        "tool; package.module:Class: your session class, imported from the current folder or "
        "PYTHONPATH (default %(default)s)",
    )
    p.add_argument(
        "--env-url",
        default=defaults.ENV_URL,
        help="OpenEnv server for --env wordle/openenv and for session classes that take a "
        "base_url (default %(default)s)",
    )
    p.add_argument(
        "--env-api-key",
        default=os.environ.get("ENV_API_KEY") or None,
        help="bearer token the environment server wants (its ENV_API_KEY; default "
        "$ENV_API_KEY); sent only to that server",
    )
    p.add_argument(
        "--max-tool-calls",
        type=count,
        default=defaults.MAX_TOOL_CALLS,
        help="tool-calling turns per rollout before it is cut off (default %(default)s: a Wordle "
        "game with two invalid moves). TRL sets no bound: a model that keeps calling tools grows "
        "its context until the rollout server rejects it and the rollout worker fails",
    )
    p.add_argument(
        "--sanity-chars",
        default=DEFAULT_CHARS,
        help="characters whose tokens the sanity reward counts (default a-z)",
    )
    p.add_argument(
        "--warmup-steps",
        type=whole,
        default=None,
        help="supervised steps on synthetic tool-call transcripts of --env before GRPO, so a "
        "model that cannot call tools yet learns the format (trainer.envs.warmup; default: "
        f"{WARMUP_STEPS} for a built model with an environment that has tools, else 0)",
    )


def _training_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--steps", type=count, default=defaults.STEPS, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--lr",
        type=learning_rate,
        default=None,
        help=f"learning rate (default {defaults.LR:g}; a built model's own: 1e-4 for small, 1e-2 "
        "for tiny)",
    )
    p.add_argument(
        "--num-generations",
        type=count,
        default=defaults.NUM_GENERATIONS,
        help="completions per prompt (at least 2)",
    )
    p.add_argument(
        "--batch-size",
        type=count,
        default=defaults.BATCH_SIZE,
        help="samples per optimizer step (a multiple of --num-generations)",
    )
    p.add_argument(
        "--max-completion-length",
        type=count,
        default=None,
        help=f"tokens per completion (default {defaults.MAX_COMPLETION_LENGTH}; for a built model "
        f"{defaults.BUILT_COMPLETION_LENGTH['sanity']} on the sanity task, "
        f"{defaults.BUILT_COMPLETION_LENGTH['tools']} with tools)",
    )


def _sync_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default=ENCODING,
        help="delta encoding (default %(default)s). ctx: about 0.7x the bytes of ans, read by "
        "tensor-parallel replicas of 1, 2, 4 or 8 workers; ans: about 3x faster to code, any "
        "tensor-parallel size",
    )
    p.add_argument(
        "--change-detection",
        choices=("auto", "host", "device"),
        default="auto",
        help="where each step's changed weights are found: on the parameters' device against a "
        "bf16 reference there (2 bytes per parameter), on the host from a bf16 copy, or auto: "
        "the device unless the parameters are on the CPU or its free memory is short (default "
        "%(default)s; the choice is logged)",
    )
    p.add_argument(
        "--anchor-interval",
        type=count,
        default=ANCHOR_INTERVAL,
        help="anchor every N versions (default %(default)s)",
    )
    p.add_argument(
        "--full-first-anchor",
        action="store_true",
        help="upload version 1 in full even when it equals the checkpoint the model came from "
        "(default: a virtual anchor naming that checkpoint, which replicas load and verify)",
    )
    p.add_argument(
        "--anchor-fraction",
        type=positive,
        default=defaults.ANCHOR_FRACTION,
        help="also anchor once deltas since the last anchor reach this share of it",
    )
    p.add_argument(
        "--verify-replicas",
        action="store_true",
        help="after each sync compare every served tensor's digest with the trainer's",
    )


def _output_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--output-dir", type=folder, default=defaults.OUTPUT_DIR, help="TRL output folder"
    )
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="where all raw output goes (default OUTPUT_DIR/train.log); the terminal shows one "
        "line per version",
    )
    p.add_argument(
        "--verbose", action="store_true", help="stream the raw output to the terminal as well"
    )
