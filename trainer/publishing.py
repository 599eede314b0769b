"""How the trainer publishes its versions: from one process, or from FSDP2 ranks that each
publish their own rows (`trainer.sharded`). Both are a `Publishing`, chosen once by `start`;
nothing else in the trainer asks which it is.

One process may continue a run (`--takeover`, `--resume`) and name the checkpoint it started from
as version 1 (a virtual anchor); ranks hold parts of the model, so they upload version 1 in full
and continue a run only by `--takeover` of a fresh start.
"""

from __future__ import annotations

import argparse
import logging
import time

from transformers import Trainer

from deltasync import AnchorPolicy, Publisher, PublisherConfig, PublishError, open_store
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.shards import ShardGroup
from deltasync.wire.source import ModelSource, resolve_source

from .resume import BucketWeights, latest_checkpoint
from .sharded import fsdp2_launched, sharded_trainer_class

__all__ = ["Fsdp2Ranks", "OneProcess", "Publishing", "publisher_config", "start"]

log = logging.getLogger("trainer")


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


class Publishing:
    """The run's publisher, and what the trainer does differently around it.

    Attributes:
        publisher: claimed for the run (a second trainer on it was refused).
        weights: the run's last committed weights, when the trainer continues it.
        checkpoint: the TRL checkpoint holding exactly those weights (`--resume`).
    """

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self.weights: BucketWeights | None = None
        self.checkpoint: str | None = None

    def trainer_class(self) -> type[Trainer]:
        from trl.experimental.async_grpo import AsyncGRPOTrainer

        return AsyncGRPOTrainer

    def attach(self, trainer: Trainer) -> None:
        """Publish under the checkpoint's tensor names (fused MoE experts go out per expert,
        as save_pretrained writes them)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.publisher.names = CheckpointNames.of(model)

    def main_process(self, trainer: Trainer) -> bool:
        """Whether this process reports the run (one of all the ranks does)."""
        return True

    def finish(self, trainer: Trainer) -> None:
        """After training: the weight transfer closes the main process's publisher."""

    @property
    def holds_whole_model(self) -> bool:
        """Whether this process holds every weight (a format warm-up trains them)."""
        return True


class OneProcess(Publishing):
    """One process holds the model and publishes every version."""


class Fsdp2Ranks(Publishing):
    """Each FSDP2 rank publishes its rows; rank 0 commits the version once every part is
    durable (`trainer.sharded.ShardedBucketSync`)."""

    def trainer_class(self) -> type[Trainer]:
        return sharded_trainer_class()

    def attach(self, trainer: Trainer) -> None:
        super().attach(trainer)
        trainer.rank_publisher = self.publisher

    def main_process(self, trainer: Trainer) -> bool:
        return trainer.accelerator.is_main_process

    def finish(self, trainer: Trainer) -> None:
        if not self.main_process(trainer):
            self.publisher.close(timeout=600)  # rank 0's transfer closes its own

    @property
    def holds_whole_model(self) -> bool:
        return False


def start(args: argparse.Namespace, model: str) -> Publishing:
    """The run's publishing, claimed: from FSDP2 ranks when launched so, else from this
    process (continuing the bucket's run with --takeover or --resume). Refusals come before
    the claim, so they leave the bucket as it was."""
    if fsdp2_launched():
        return _ranks(args)
    return _one_process(args, model)


def _one_process(args: argparse.Namespace, model: str) -> OneProcess:
    run_id = args.run_id or _new_run_id()
    # version 1 names the checkpoint when the weights still equal it (no full upload)
    source = None if args.full_first_anchor else resolve_source(model)
    publishing = OneProcess(
        Publisher(open_store(args.bucket), publisher_config(args, run_id, source))
    )
    publishing.weights, publishing.checkpoint = _continued(args, publishing.publisher)
    _claim(publishing.publisher)
    return publishing


def _ranks(args: argparse.Namespace) -> Fsdp2Ranks:
    if args.verify_replicas:
        raise SystemExit("--verify-replicas hashes whole tensors, which no FSDP2 rank holds")
    if args.resume:
        raise SystemExit("--resume is not supported with FSDP2 ranks yet; use --takeover")
    shards = ShardGroup()
    run_id = shards.broadcast(args.run_id or _new_run_id())  # rank 0's clock names the run
    config = publisher_config(args, run_id, None)
    publishing = Fsdp2Ranks(Publisher(open_store(args.bucket), config, shards=shards))
    _claim(publishing.publisher)
    return publishing


def _new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}"


def _claim(publisher: Publisher) -> None:
    """Before any training work: a second trainer on the run is refused in one line."""
    try:
        publisher.claim()
    except PublishError as exc:
        raise SystemExit(f"error: {exc}") from None


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
