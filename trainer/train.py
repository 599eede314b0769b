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
import functools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import torch
from transformers import TrainerCallback

from deltasync.arguments import (
    is_loopback,
)
from deltasync.vllm_ext.client import ReplicaClient

from . import arguments, defaults
from .auth_proxy import AuthProxy
from .console import console, last_lines, quiet_output
from .envs.report import EnvReport, RolloutTap
from .envs.spec import EnvSetupError, EnvSpec, dataset_rows, preflight, resolve
from .envs.warmup import WARMUP_STEPS, warm_up
from .publishing import Publishing
from .publishing import start as start_publishing
from .resume import load_into
from .rewards import RewardCallback, StepRewards
from .routing import within_staleness
from .tasks import sanity_dataset, sanity_reward
from .weight_sync import BucketWeightTransfer, SyncState

log = logging.getLogger("trainer")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's flags (`trainer.arguments`), under this module's docstring."""
    return arguments.build_parser(__doc__)


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
    """The run, step by step: the environment checked, the model, the rollout proxy and TRL's
    config, the publisher claimed, the weight transfer, the trainer, training, the summary."""
    from transformers import AutoTokenizer

    from .config import build_config, built_preset, max_staleness, prepare_model
    from .cpu import enable_cpu_training

    env = None if args.env == "sanity" else _environment(args)
    cpu = not torch.cuda.is_available()
    if cpu:
        enable_cpu_training()
    model = prepare_model(args.model, args.model_dir, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    fleet = Fleet.of(args)
    synced = SyncState()  # the transfer records each replica's version; the proxy routes by it
    with _rollout_proxy(args, fleet, synced, max_staleness(args, cpu)) as proxy:
        config = build_config(args, model=model, cpu=cpu, vllm_url=proxy.url)
        publishing = start_publishing(args, model)  # after the config: it sets up the ranks
        rewards = StepRewards()
        transfer = BucketWeightTransfer(
            publishing.publisher,
            fleet.driven,
            bucket=args.bucket,
            verify_digests=args.verify_replicas,
            rewards=rewards,
            followers=fleet.followers,
            stopped=lambda: proxy.stop_reason is not None,
            state=synced,
        )
        trainer = publishing.trainer_class()(
            model=model,
            args=config,
            processing_class=tokenizer,
            weight_transfer=transfer,
            **_task(args, tokenizer, env),
        )
        rewards.track(trainer)
        publishing.attach(trainer)
        _continue_or_warm_up(args, trainer, publishing, tokenizer, env, built_preset(model), config)
        report = _callbacks(args, trainer, rewards, env, cpu, publishing.publisher.config.run_id)
        console.info(
            "run %s: %d steps of %s, bucket %s, replicas %s",
            publishing.publisher.config.run_id,
            args.steps,
            args.model,
            args.bucket,
            ", ".join(fleet.named),
        )
        try:
            trainer.train(resume_from_checkpoint=publishing.checkpoint)
        except RuntimeError:  # TRL's rollout worker died: of the proxy's stop answer?
            if proxy.stop_reason is None:
                raise
    if proxy.stop_reason is not None:  # a replica died or refused rollouts for good
        raise RolloutsStopped(f"error: {proxy.stop_reason}")
    publishing.finish(trainer)
    return _summary(args, transfer, publishing, trainer, report)


@dataclass(frozen=True)
class Fleet:
    """The rollout replicas by name: `vllm-i` the trainer syncs (driven), `follower-i` those
    that follow the bucket themselves (it only reads what they serve)."""

    named: dict[str, str]
    driven: dict[str, ReplicaClient]
    followers: dict[str, ReplicaClient]

    @classmethod
    def of(cls, args: argparse.Namespace) -> Fleet:
        urls = args.vllm_server_url or ([] if args.follower_url else [defaults.VLLM_URL])
        driven = {f"vllm-{i}": u for i, u in enumerate(urls)}
        following = {f"follower-{i}": u for i, u in enumerate(args.follower_url or [])}
        key = args.vllm_api_key
        return cls(
            driven | following,
            {n: ReplicaClient(u, key) for n, u in driven.items()},
            {n: ReplicaClient(u, key) for n, u in following.items()},
        )


def _rollout_proxy(
    args: argparse.Namespace, fleet: Fleet, synced: SyncState, staleness: int
) -> AuthProxy:
    """TRL talks to one URL without credentials: a loopback proxy adds the token and spreads its
    rollouts over the replicas within `staleness` versions of the freshest."""
    urls = list(fleet.named.values())
    return AuthProxy(
        urls,
        args.vllm_api_key,
        eligible=functools.partial(within_staleness, synced.synced, fleet.named, staleness),
        dead_after_s=args.replica_down_after or _down_after(urls),
    )


def _continue_or_warm_up(
    args: argparse.Namespace,
    trainer,
    publishing: Publishing,
    tokenizer,
    env: EnvSpec | None,
    built: bool,
    config,
) -> None:
    """The weights the run continues from (`--takeover` without a checkpoint), or the format
    warm-up a built model needs before it can call an environment's tools."""
    if publishing.weights is not None and publishing.checkpoint is None:
        load_into(trainer.model, publishing.weights)
        log.info(
            "continuing run %s from version %d",
            publishing.weights.run_id,
            publishing.weights.version,
        )
    if env is not None and (steps := _warmup_steps(args, built, env, publishing)):
        result = warm_up(
            trainer.accelerator.unwrap_model(trainer.model),
            tokenizer,
            env,
            steps=steps,
            chat_template_kwargs=config.chat_template_kwargs,
        )
        console.info("%s", result.line())


def _callbacks(
    args: argparse.Namespace,
    trainer,
    rewards: StepRewards,
    env: EnvSpec | None,
    cpu: bool,
    run_id: str,
) -> EnvReport | None:
    """The trainer's callbacks and rollout hooks: rewards by step, failed rollouts reaped, one
    group scored ahead on a CPU, the environment report's tap, and the drain at the end."""
    from .cpu import score_one_group_ahead

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
    return report


def _summary(
    args: argparse.Namespace,
    transfer: BucketWeightTransfer,
    publishing: Publishing,
    trainer,
    report: EnvReport | None,
) -> int:
    """The run's last lines: the versions each replica serves, latency, the environment report;
    1 if a replica lags."""
    lagging = sorted(transfer.state.lagging)
    serving = ", ".join(f"{name} serves v{v}" for name, v in sorted(transfer.state.synced.items()))
    console.info(
        "last version %s; %s%s",
        publishing.publisher.committed_version,
        serving or "no replica verified",
        f"; lagging: {', '.join(lagging)}" if lagging else "",
    )
    if latency := transfer.latency_summary():
        console.info("%s", latency)
    if report is not None and publishing.main_process(trainer):
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


def _down_after(urls: Sequence[str]) -> float:
    """A local replica that fails /health for seconds is dead; a Space restarts in minutes."""
    local = all(is_loopback(urlsplit(u).hostname or "") for u in urls)
    return defaults.LOCAL_DOWN_AFTER_S if local else defaults.REMOTE_DOWN_AFTER_S


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
    args: argparse.Namespace, built: bool, env: EnvSpec, publishing: Publishing
) -> int:
    """The format warm-up's steps: --warmup-steps, else some for a built model (which cannot
    call tools) on an environment with tools, never for a run that continues trained weights
    or for ranks that each hold part of the model."""
    why = _no_warmup(env, publishing)
    if why:
        if args.warmup_steps:
            console.warning("warning: --warmup-steps ignored (%s)", why)
        return 0
    if args.warmup_steps is not None:
        return args.warmup_steps
    return WARMUP_STEPS if built else 0


def _no_warmup(env: EnvSpec, publishing: Publishing) -> str:
    """Why no warm-up can run ("" if one can)."""
    if publishing.weights is not None:
        return "the run continues trained weights"
    if not publishing.holds_whole_model:
        return "FSDP2 ranks hold parts of the model"
    return "" if env.tools else "the environment has no tools"


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
