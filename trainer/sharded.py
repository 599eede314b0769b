"""Multi-GPU training under FSDP2: every rank publishes its own shard through the bucket.

TRL's `AsyncGRPOTrainer._sync_weight_merged` all-gathers each parameter (`full_tensor()`) so
that rank 0 alone can send whole tensors. For the bucket transport that gather is wasted: each
rank diffs its own rows (`deltasync.publisher.shards`) and uploads its part, and rank 0 commits the
version once every part is durable. `ShardedBucketSync` replaces that one method; the rest of
TRL's sync (barriers, model version, the rollout worker) is kept as TRL does it.

    accelerate launch --config_file trainer/accelerate_fsdp2.yaml -m trainer.train ...
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future

from deltasync import Publisher

__all__ = ["ShardedBucketSync", "fsdp2_launched", "sharded_trainer_class"]

log = logging.getLogger("trainer.sharded")


def fsdp2_launched() -> bool:
    """Whether this process is one of several ranks of an FSDP2 launch (`accelerate launch`
    with `fsdp_version: 2`); the training arguments must have set the process state up."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    return (
        state.num_processes > 1
        and state.distributed_type == DistributedType.FSDP
        and os.environ.get("FSDP_VERSION") == "2"
    )


class ShardedBucketSync:
    """Mixed in before `AsyncGRPOTrainer`: with `rank_publisher` set, a weight sync publishes
    each rank's rows of every parameter, without all-gathering any.

    Rank 0 hands its (sharded) parameters to the trainer's `weight_transfer`
    (`BucketWeightTransfer`, whose publisher was built with the same `ShardGroup`), which also
    drives the replicas once the version commits; every other rank publishes its part through
    `rank_publisher`. A rank whose part fails makes the version fail on every rank, and its
    next sync raises (`Publisher`'s sharded rule): the job stops, and a restart resumes.
    """

    rank_publisher: Publisher | None = None

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        if self.rank_publisher is None:
            return super()._sync_weight_merged(t0)  # type: ignore[misc]
        from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

        accelerator = self.accelerator  # type: ignore[attr-defined]
        transfer = self.weight_transfer  # type: ignore[attr-defined]
        main = accelerator.is_main_process
        if main and transfer is not None:
            transfer.pause()
        t_pause = time.time()
        accelerator.wait_for_everyone()
        t_barrier = time.time()
        named = list(_iter_vllm_named_params(accelerator.unwrap_model(self.model)))  # type: ignore[attr-defined]
        if main and transfer is not None:
            transfer.send_weights(iter(named))
        else:
            self.rank_publisher.publish(named).add_done_callback(_log_failure)
        t_transfer = time.time()
        accelerator.wait_for_everyone()
        if main:
            if transfer is not None:
                transfer.resume()
            self.model_version += 1  # type: ignore[attr-defined]
            if self.rollout_worker is not None:  # type: ignore[attr-defined]
                self.rollout_worker.update_model_version(self.model_version)  # type: ignore[attr-defined]
        return t_pause, t_barrier, t_transfer


def sharded_trainer_class() -> type:
    """TRL's `AsyncGRPOTrainer` with `ShardedBucketSync` in front of it."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class ShardedAsyncGRPOTrainer(ShardedBucketSync, AsyncGRPOTrainer):
        """`AsyncGRPOTrainer` whose weight syncs publish every rank's shard."""

    return ShardedAsyncGRPOTrainer


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("this rank's part was not published: %s", future.exception())
