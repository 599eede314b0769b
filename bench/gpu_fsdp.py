"""Part 7 of the GPU check: FSDP2 at world size 1 on the device, through the sharded publish.

    PYTHONPATH=. python -m bench.gpu_fsdp --json fsdp.json            # cuda (nccl + gloo)
    PYTHONPATH=. python -m bench.gpu_fsdp --device cpu --small         # CI dry run (gloo)

One process is the whole group (`init_process_group` with a local TCP store; `cpu:gloo,cuda:nccl`
on CUDA). A Qwen3-shaped model is wrapped in `fully_shard` per layer and at the root, so every
parameter is a `DTensor` on the device, as under `torchrun` (`tests/scale/fsdp_train.py`); AdamW
steps on random tokens, and each step is published with a `ShardGroup` (the rank's rows, its
part file) to a local bucket, change detection `auto`. A replica then syncs the bucket: every
tensor must equal the model's bf16 view bit for bit. Reported: per-version publish time (diff,
encode, upload), changed elements and bytes.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from .gpu_common import part_main, shape_of, synchronize

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, part, device: torch.device) -> bool:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    from deltasync import Publisher, PublisherConfig
    from deltasync.publisher.shards import ShardGroup
    from deltasync.publisher.snapshot import bf16_view
    from deltasync.replica.replica import Replica
    from deltasync.store import LocalStore
    from deltasync.wire.policy import AnchorPolicy

    from .models.qwen3 import build_config

    shape = shape_of("qwen3-micro" if args.small else "qwen3-0.6b")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(build_config(shape)).float()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        kinds = {type(p).__name__ for p in model.parameters()}
        part.update(shape=shape.__dict__, backend=backend, parameter_types=sorted(kinds))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        rows = []
        with tempfile.TemporaryDirectory() as bucket:
            config = PublisherConfig(
                run_id="gpu-fsdp",
                policy=AnchorPolicy(interval=None, max_delta_fraction=None),
                write_metrics=False,
            )
            with Publisher(LocalStore(bucket), config, shards=ShardGroup()) as publisher:
                for step in range(args.steps + 1):
                    if step:  # step 0 publishes the initial weights (the anchor)
                        tokens = torch.randint(0, vocab, (2, 64), generator=gen).to(device)
                        model(input_ids=tokens, labels=tokens).loss.backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    synchronize(device)
                    t0 = time.perf_counter()
                    record = publisher.publish(model).result(timeout=120)
                    rows.append(
                        {
                            "version": record.version,
                            "publish_s": time.perf_counter() - t0,
                            "diff_s": record.diff_s,
                            "encode_s": record.encode_s,
                            "upload_s": record.upload_s,
                            "changed": record.changed_elements,
                            "elements": record.total_elements,
                            "bytes": record.delta_bytes + record.anchor_bytes,
                        }
                    )
                    part.update(versions=rows)
            replica = Replica()
            applied = replica.sync(LocalStore(bucket))
            served = replica.tensors
            want = {n: bf16_view(p.full_tensor()) for n, p in model.named_parameters()}
            differing = [
                n
                for n, t in want.items()
                if n not in served
                or not torch.equal(served[n].view(torch.int16), t.view(torch.int16))
            ]
            part.update(
                replica_versions=applied,
                replica_equals_model=not differing,
                differing=differing[:10],
            )
        return not differing and replica.version == args.steps + 1
    finally:
        dist.destroy_process_group()


def _options(p) -> None:
    p.add_argument("--steps", type=int, default=2, help="optimizer steps, each one published")
    p.add_argument("--lr", type=float, default=1e-4)


def table(result: dict) -> str:
    """Each published version: density, publish time and its parts, bytes."""
    lines = [
        "| version | density | publish | diff / encode / upload | bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in result["versions"]:
        name = f"{v['version']} (anchor)" if v["changed"] == v["elements"] else str(v["version"])
        lines.append(
            f"| {name} | {100 * v['changed'] / v['elements']:.3g} % | {v['publish_s']:.2f} s | "
            f"{v['diff_s']:.2f} / {v['encode_s']:.2f} / {v['upload_s']:.2f} s | "
            f"{v['bytes'] / 1e6:.0f} MB |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_fsdp", __doc__, run, argv, _options, table)


if __name__ == "__main__":
    sys.exit(main())
