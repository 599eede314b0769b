"""A plain FSDP2 training loop that publishes every step from every rank (run with torchrun).

    torchrun --nproc_per_node 2 tests/scale/fsdp_train.py --bucket DIR --steps 10 --expected OUT

`--family NAME` trains one of `bench.models.families` instead (e.g. qwen3-moe: each rank holds
half the experts of every fused expert tensor and publishes the per-expert checkpoint tensors in
them).

Each rank wraps a Qwen3-shaped model in `fully_shard` (gloo), takes AdamW steps on random tokens
and calls `Publisher.publish(model)` with a `ShardGroup`: it diffs only its rows and uploads its
part. With `--expected`, the ranks also all-gather every parameter after each publish and rank 0
saves the full bf16 state per version (for the tests' bitwise comparison only). With
`--crash-rank R --crash-version V`, rank R dies (`os._exit`) while uploading its part of version
V, before the upload lands (with `--fail-instead` its upload raises instead, and every rank
exits with status 3 at that version). `--resume` continues a run from the bucket's last
committed version: the model is loaded from the replayed bucket first (what a restart does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from bench.models.qwen3 import uneven_qwen3
from deltasync import Publisher, PublisherConfig
from deltasync.defaults import ENCODING
from deltasync.errors import PublishError
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.shards import ShardGroup
from deltasync.publisher.snapshot import bf16_view
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.policy import AnchorPolicy


class FaultyStore(LocalStore):
    """Dies (`os._exit`) or fails (`OSError`) while writing one rank's part of one version,
    before the bytes land."""

    def __init__(self, root: str, marker: str | None, *, die: bool):
        super().__init__(root)
        self.marker, self.die = marker, die

    def put(self, path: str, data: bytes) -> None:
        if self.marker is not None and self.marker in path:
            if self.die:
                os._exit(17)
            raise OSError(f"injected upload failure for {path}")
        super().put(path, data)


def full_state(model: torch.nn.Module, names: CheckpointNames) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor gathered (a collective on every rank), as bf16 on the CPU."""
    gathered = [(n, bf16_view(p.full_tensor())) for n, p in model.named_parameters()]
    return {n: t.clone() for n, t in names.apply(gathered)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--run-id", default="fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--vocab", type=int, default=509)
    parser.add_argument("--intermediate", type=int, default=130)
    parser.add_argument("--family", help="a bench.models.families model, not the Qwen3 shape")
    parser.add_argument("--anchor-interval", type=int, default=4)
    parser.add_argument("--keep-anchors", type=int, default=8)
    parser.add_argument("--unsharded-root", action="store_true", help="fully_shard layers only")
    parser.add_argument("--expected", help="folder for the full bf16 state of each version")
    parser.add_argument("--crash-rank", type=int)
    parser.add_argument("--crash-version", type=int)
    parser.add_argument("--fail-instead", action="store_true", help="raise instead of dying")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--encoding", default=ENCODING, help="the publisher's delta encoding")
    parser.add_argument("--report", help="JSON file: per-rank memory and timings")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if args.family:
        from transformers import AutoModelForCausalLM

        from bench.models.families import family_config

        args.vocab = family_config(args.family).vocab_size
        model = AutoModelForCausalLM.from_config(family_config(args.family)).float()
    else:
        model = uneven_qwen3(args.vocab, args.intermediate, seed=0)
    names = CheckpointNames.of(model)
    if args.resume:  # a restarted trainer starts from the weights the bucket holds
        replica = Replica()
        replica.sync(LocalStore(args.bucket))
        model.load_state_dict({n: t.float() for n, t in replica.tensors.items()}, strict=False)
        del replica
    for layer in model.model.layers:
        fully_shard(layer)
    if not args.unsharded_root:  # else embeddings, final norm and head stay plain tensors
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1 + rank)

    marker = None
    if args.crash_rank == rank and args.crash_version is not None:
        marker = f"{args.crash_version:08d}-part{rank}of"
    store = FaultyStore(args.bucket, marker, die=not args.fail_instead)
    config = PublisherConfig(
        run_id=args.run_id,
        policy=AnchorPolicy(
            interval=args.anchor_interval, max_delta_fraction=None, keep_anchors=args.keep_anchors
        ),
        takeover=args.resume,
        encoding=args.encoding,
    )
    shards = ShardGroup()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    records = []
    with Publisher(store, config, shards=shards) as publisher:
        for step in range(args.steps + 1):
            if step:  # step 0 publishes the initial weights
                tokens = torch.randint(0, args.vocab, (2, 16), generator=generator)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            started = time.perf_counter()
            try:
                record = publisher.publish(model).result(timeout=300)
            except PublishError as exc:  # every rank stops at the version a rank failed
                print(f"rank {rank}: {exc}", file=sys.stderr)
                sys.exit(3)
            records.append(
                {
                    "version": record.version,
                    "changed": record.changed_elements,
                    "bytes": record.delta_bytes + record.anchor_bytes,
                    "publish_s": time.perf_counter() - started,
                }
            )
            if args.expected:
                state = full_state(model, names)
                if rank == 0:
                    out = Path(args.expected) / f"{record.version:08d}.safetensors"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    safetensors.torch.save_file(state, str(out))
                del state
    if args.report:
        report = {
            "rank": rank,
            "world_size": dist.get_world_size(),
            "max_rss_before_publisher": rss_before,
            "records": records,
        }
        Path(f"{args.report}.rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
