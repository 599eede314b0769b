r"""Async GRPO (TRL) that syncs weights to rollout replicas through a bucket: on one GPU, on a
CPU, or as FSDP2 ranks that each publish their own rows (`trainer.sharded`).

    # the default: a small random Qwen3 built offline, the sanity task, one local replica on :8001
    python -m trainer.train --bucket ./bucket --vllm-server-url http://127.0.0.1:8001
    # Wordle through its OpenEnv server, a real model, two replicas, a Hub bucket
    python -m trainer.train --model Qwen/Qwen3-1.7B --env wordle --env-url http://127.0.0.1:8002 \
        --bucket hf://buckets/me/rl --vllm-server-url https://me-vllm-0.hf.space \
        --vllm-server-url https://me-vllm-1.hf.space --lr 1e-6

The weight sync is `trainer.weight_sync.BucketWeightTransfer`, passed to TRL's AsyncGRPOTrainer
as `weight_transfer=`; the bucket protocol is in bucket_layout.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import torch
from transformers import TrainerCallback

from deltasync import AnchorPolicy, Publisher, PublisherConfig, PublishError, open_store, settings
from deltasync.arguments import (
    bucket_url,
    count,
    folder,
    http_url,
    is_loopback,
    learning_rate,
    model_ref,
    positive,
    whole,
)
from deltasync.codec import ENCODINGS
from deltasync.defaults import ANCHOR_INTERVAL, ENCODING
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.shards import ShardGroup
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.source import ModelSource, resolve_source

from . import defaults
from .auth_proxy import AuthProxy
from .console import console, last_lines, quiet_output
from .envs.report import EnvReport, RolloutTap
from .envs.spec import EnvSetupError, EnvSpec, dataset_rows, env_arg, preflight, resolve
from .envs.warmup import WARMUP_STEPS, warm_up
from .resume import BucketWeights, latest_checkpoint, load_into
from .rewards import RewardCallback, StepRewards
from .routing import within_staleness
from .sharded import fsdp2_launched, sharded_trainer_class
from .tasks import DEFAULT_CHARS, sanity_dataset, sanity_reward
from .weight_sync import BucketWeightTransfer

log = logging.getLogger("trainer")
_LOCAL_DOWN_AFTER_S = 10.0
_REMOTE_DOWN_AFTER_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        f"{_LOCAL_DOWN_AFTER_S:.0f} s on this machine, {_REMOTE_DOWN_AFTER_S:.0f} s when a "
        "replica is remote, e.g. a Space that restarts)",
    )
    p.add_argument(
        "--vllm-api-key",
        default=settings.API_KEY.read() or None,
        help=f"bearer token of the rollout servers (default ${settings.API_KEY.name})",
    )
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
        default=8,
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
        "--steps", type=count, default=defaults.STEPS, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--lr",
        type=learning_rate,
        default=None,
        help="learning rate (default 1e-6; a built model's own: 1e-4 for small, 1e-2 for tiny)",
    )
    p.add_argument(
        "--num-generations", type=count, default=8, help="completions per prompt (at least 2)"
    )
    p.add_argument(
        "--batch-size",
        type=count,
        default=8,
        help="samples per optimizer step (a multiple of --num-generations)",
    )
    p.add_argument(
        "--max-completion-length",
        type=count,
        default=None,
        help="tokens per completion (default 1024; 16 for a built model)",
    )
    p.add_argument(
        "--warmup-steps",
        type=whole,
        default=None,
        help="supervised steps on synthetic tool-call transcripts of --env before GRPO, so a "
        "model that cannot call tools yet learns the format (trainer.envs.warmup; default: "
        f"{WARMUP_STEPS} for a built model with an environment that has tools, else 0)",
    )
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
        default=0.5,
        help="also anchor once deltas since the last anchor reach this share of it",
    )
    p.add_argument(
        "--verify-replicas",
        action="store_true",
        help="after each sync compare every served tensor's digest with the trainer's",
    )
    p.add_argument("--output-dir", type=folder, default="./out/trainer", help="TRL output folder")
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
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Train with a quiet terminal: raw output in the log file, one line per version."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_generations < 2:
        parser.error("--num-generations must be at least 2 (GRPO compares completions)")
    if args.batch_size % args.num_generations:
        parser.error(
            f"--batch-size {args.batch_size} must be a multiple of --num-generations "
            f"{args.num_generations} (whole groups per step)"
        )
    log_file = args.log_file or Path(args.output_dir) / "train.log"
    try:
        with quiet_output(log_file, verbose=args.verbose):
            try:
                return _train(args)
            except Exception as exc:
                log.exception("training failed")
                console.error(
                    "error: %s: %s\nlast lines of %s:\n%s",
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                    log_file,
                    last_lines(log_file),
                )
                return 1
    except RolloutsStopped as stop:  # output restored: the line reaches the terminal and log
        _exit_now(str(stop))


def _train(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from .config import build_config, built_preset, prepare_model
    from .cpu import enable_cpu_training, score_one_group_ahead

    env = None if args.env == "sanity" else _environment(args)
    cpu = not torch.cuda.is_available()
    if cpu:
        enable_cpu_training()
    model = prepare_model(args.model, args.model_dir, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    driven = args.vllm_server_url or ([] if args.follower_url else [defaults.VLLM_URL])
    following = {f"follower-{i}": u for i, u in enumerate(args.follower_url or [])}
    named = {f"vllm-{i}": u for i, u in enumerate(driven)} | following
    urls = list(named.values())
    stack = contextlib.ExitStack()
    # TRL talks to one URL without credentials: a loopback proxy adds the token and spreads its
    # rollouts over the replicas within its staleness (the gate is read during train() only)
    proxy = AuthProxy(
        urls,
        args.vllm_api_key,
        eligible=lambda: within_staleness(transfer.state.synced, named, config.max_staleness),
        dead_after_s=args.replica_down_after or _down_after(urls),
    )
    config = build_config(args, model=model, cpu=cpu, vllm_url=stack.enter_context(proxy).url)
    sharded = fsdp2_launched()  # FSDP2 ranks: each publishes its own rows
    if sharded and args.verify_replicas:
        raise SystemExit("--verify-replicas hashes whole tensors, which no FSDP2 rank holds")
    if sharded and args.resume:
        raise SystemExit("--resume is not supported with FSDP2 ranks yet; use --takeover")
    shards = ShardGroup() if sharded else None
    run_id = args.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    if shards is not None:
        run_id = shards.broadcast(run_id)  # rank 0's clock names the run for every rank
    # version 1 names the checkpoint when the weights still equal it (no full upload)
    source = None if sharded or args.full_first_anchor else resolve_source(model)
    publisher = Publisher(
        open_store(args.bucket), publisher_config(args, run_id, source), shards=shards
    )
    # refusals before the claim leave the bucket as it was
    weights, checkpoint = _continued(args, publisher) if not sharded else (None, None)
    try:  # before any training work: a second trainer on the run is refused in one line
        publisher.claim()
    except PublishError as exc:
        raise SystemExit(f"error: {exc}") from None
    clients = {n: ReplicaClient(u, args.vllm_api_key) for n, u in named.items()}
    replicas = {n: c for n, c in clients.items() if n not in following}
    rewards = StepRewards(step=lambda: trainer.state.global_step)  # read during train() only
    transfer = BucketWeightTransfer(
        publisher,
        replicas,
        bucket=args.bucket,
        verify_digests=args.verify_replicas,
        rewards=rewards,
        followers={n: c for n, c in clients.items() if n in following},
        stopped=lambda: proxy.stop_reason is not None,
    )
    task = _task(args, tokenizer, env)
    trainer_class = sharded_trainer_class() if sharded else AsyncGRPOTrainer
    trainer = trainer_class(
        model=model, args=config, processing_class=tokenizer, weight_transfer=transfer, **task
    )
    # TRL hands over in-memory names; the wire carries the checkpoint's (fused MoE experts
    # go out per expert, as save_pretrained writes them)
    publisher.names = CheckpointNames.of(trainer.accelerator.unwrap_model(trainer.model))
    if sharded:
        trainer.rank_publisher = publisher
    if weights is not None and checkpoint is None:
        load_into(trainer.model, weights)
        log.info("continuing run %s from version %d", weights.run_id, weights.version)
    built = built_preset(model)
    if env is not None and (steps := _warmup_steps(args, built, env, weights, sharded)):
        result = warm_up(
            trainer.accelerator.unwrap_model(trainer.model),
            tokenizer,
            env,
            steps=steps,
            chat_template_kwargs=config.chat_template_kwargs,
        )
        console.info("%s", result.line())
    trainer.add_callback(RewardCallback(rewards))
    if trainer.rollout_worker is not None:
        _reap_failed_rollouts(trainer.rollout_worker)
        if cpu:
            score_one_group_ahead(trainer.rollout_worker)
    report = EnvReport(run_id, args.env, env.reward, env.tools) if env else None
    if report is not None:
        tap = None
        if trainer.rollout_queue is not None:  # before train() builds its dataset on the queue
            trainer.rollout_queue = tap = RolloutTap(trainer.rollout_queue, report)
        trainer.add_callback(_ReportCallback(report, tap))
    trainer.add_callback(_DrainRollouts(trainer))  # after the tap stops: drained rows are untrained
    console.info(
        "run %s: %d steps of %s, bucket %s, replicas %s",
        run_id,
        args.steps,
        args.model,
        args.bucket,
        ", ".join(named),
    )
    with stack:
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
        except RuntimeError:  # TRL's rollout worker died: of the proxy's stop answer?
            if proxy.stop_reason is None:
                raise
    if proxy.stop_reason is not None:  # a replica died or refused rollouts for good
        raise RolloutsStopped(f"error: {proxy.stop_reason}")
    if sharded and not trainer.accelerator.is_main_process:
        publisher.close(timeout=600)  # rank 0's transfer closes its own
    lagging = sorted(transfer.state.lagging)
    serving = ", ".join(f"{name} serves v{v}" for name, v in sorted(transfer.state.synced.items()))
    console.info(
        "last version %s; %s%s",
        publisher.committed_version,
        serving or "no replica verified",
        f"; lagging: {', '.join(lagging)}" if lagging else "",
    )
    if latency := transfer.latency_summary():
        console.info("%s", latency)
    if report is not None and (not sharded or trainer.accelerator.is_main_process):
        if summary := report.summary():
            console.info("environment %s", summary)
        for warning in report.warnings():
            console.warning("warning: %s", warning)
        report.save(args.output_dir)
    return 1 if lagging else 0


class RolloutsStopped(SystemExit):
    """Rollouts cannot go on (every replica down, or a request refused for good): the run ends
    with this one line, without joining threads (`_exit_now`)."""


def _exit_now(line: str) -> NoReturn:
    """Print `line` and exit 1 without joining threads: a replica sync may be blocked on an RPC
    that a dead vLLM engine never answers, which would hold the exit until its timeout."""
    print(line, file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)


def publisher_config(
    args: argparse.Namespace, run_id: str, source: ModelSource | None
) -> PublisherConfig:
    """The publisher's settings from the trainer's flags."""
    return PublisherConfig(
        run_id=run_id,
        encoding=args.encoding,
        change_detection=args.change_detection,
        policy=AnchorPolicy(interval=args.anchor_interval, max_delta_fraction=args.anchor_fraction),
        write_metrics=False,  # the transfer writes each record once, replicas and reward in
        source=source,
        takeover=args.takeover or args.resume,
    )


def _down_after(urls: Sequence[str]) -> float:
    """A local replica that fails /health for seconds is dead; a Space restarts in minutes."""
    local = all(is_loopback(urlsplit(u).hostname or "") for u in urls)
    return _LOCAL_DOWN_AFTER_S if local else _REMOTE_DOWN_AFTER_S


def _continued(
    args: argparse.Namespace, publisher: Publisher
) -> tuple[BucketWeights | None, str | None]:
    """With --takeover or --resume on a run the bucket holds: its last committed weights, and
    for --resume the TRL checkpoint holding exactly them (else a one-line refusal)."""
    if not (args.takeover or args.resume):
        return None, None
    weights = BucketWeights.read(publisher.store, publisher.config.run_id)
    if weights is None:  # a new run: nothing to continue
        if args.resume:
            raise SystemExit(f"error: --resume: the bucket holds no run {publisher.config.run_id}")
        return None, None
    publisher.resume_from(weights.replica)  # the chain is downloaded once
    if not args.resume:
        return weights, None
    checkpoint = latest_checkpoint(args.output_dir)
    weights.check_checkpoint(checkpoint)
    log.info("resuming run %s at version %d from %s", weights.run_id, weights.version, checkpoint)
    return weights, str(checkpoint)


def _environment(args: argparse.Namespace) -> EnvSpec:
    """--env resolved and pre-flighted before any model is loaded (one line if it cannot be
    played)."""
    try:
        spec = preflight(resolve(args.env, args.env_url, args.env_api_key))
    except EnvSetupError as exc:
        raise SystemExit(f"error: {exc}") from None
    tools = ", ".join(spec.tools) or "none"
    console.info("environment %s: tools %s; reward: %s", args.env, tools, spec.reward)
    return spec


def _warmup_steps(
    args: argparse.Namespace,
    built: bool,
    env: EnvSpec,
    weights: BucketWeights | None,
    sharded: bool,
) -> int:
    """The format warm-up's steps: --warmup-steps, else some for a built model (which cannot
    call tools) on an environment with tools, never for a run that continues trained weights."""
    if weights is not None or sharded or not env.tools:
        if args.warmup_steps:
            console.warning("warning: --warmup-steps ignored (%s)", _no_warmup(weights, sharded))
        return 0
    if args.warmup_steps is not None:
        return args.warmup_steps
    return WARMUP_STEPS if built else 0


def _no_warmup(weights: BucketWeights | None, sharded: bool) -> str:
    if weights is not None:
        return "the run continues trained weights"
    return "FSDP2 ranks hold parts of the model" if sharded else "the environment has no tools"


def _task(args: argparse.Namespace, tokenizer, env: EnvSpec | None) -> dict:
    if env is None:
        ids = {tuple(tokenizer.encode(c, add_special_tokens=False)) for c in args.sanity_chars}
        if not ids or any(len(i) != 1 for i in ids):
            raise SystemExit(f"--sanity-chars {args.sanity_chars!r}: each must be one token")
        token_ids = frozenset(i[0] for i in ids)
        return {"reward_funcs": [sanity_reward(token_ids)], "train_dataset": sanity_dataset()}
    from datasets import Dataset

    return {
        "environment_factory": env.factory,
        "train_dataset": Dataset.from_list(dataset_rows(env)),
        "reward_funcs": [],
    }


class _ReportCallback(TrainerCallback):
    """Feeds every dict TRL logs to the environment report."""

    def __init__(self, report: EnvReport, tap: RolloutTap | None):
        self.report, self.tap = report, tap

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.report.observe(logs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tap is not None:
            self.tap.stop()


class _DrainRollouts(TrainerCallback):
    """At train end, keep emptying the rollout queue so TRL's rollout child can exit at once
    (otherwise it blocks on a full queue and is killed after TRL's 15 s join timeout)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        rollouts = self.trainer.rollout_queue
        if rollouts is None:
            return

        def drain(deadline: float = time.monotonic() + 30) -> None:
            while time.monotonic() < deadline:
                try:
                    rollouts.get(timeout=0.2)
                except queue.Empty:
                    continue
                except (EOFError, OSError, ValueError):  # queue closed: the child is gone
                    return

        threading.Thread(target=drain, name="drain-rollouts", daemon=True).start()


def _reap_failed_rollouts(worker) -> None:
    """Keep TRL 1.16 from hanging at shutdown once its rollout child has died (a failed
    rollout, or the proxy's stop answer): `stop()` sets a multiprocessing Event whose
    `set()` waits for every registered waiter to wake, and the dead child's stop-watcher thread
    was one, so it waits forever. A child that failed exits by itself: wait for that, and
    `stop()` then finds nothing to stop."""
    stop = worker.stop

    def reaping_stop() -> None:
        process = worker._process
        if process is not None and (worker._failed_event.is_set() or not process.is_alive()):
            process.join(timeout=30)
            if not process.is_alive():
                worker._process = None
        stop()

    worker.stop = reaping_stop


if __name__ == "__main__":
    sys.exit(main())
