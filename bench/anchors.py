"""Would compressing anchors pay? zstd over bf16 bytes as stored, and byte-grouped (each tensor's
high bytes - sign, exponent, one mantissa bit - then its low bytes, as ZipNN does), against the
plain file. Sizes and single-thread throughput per level, on a model shape's std-0.02 init.

Usage:
  .venv/bin/python -m bench.anchors --model qwen3-0.6b --levels 1 3 \
      --json bench/results/anchors-qwen3-0.6b.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import zstandard

from deltasync.arguments import json_path, zstd_level

from .models.qwen3 import SHAPES
from .output import report
from .synthetic import synthetic_states


def _grouped(bits: np.ndarray) -> bytes:
    raw = bits.view(np.uint8).reshape(-1, 2)
    return raw[:, 1].tobytes() + raw[:, 0].tobytes()  # little-endian: high byte is the second


def measure(model: str, levels: list[int]) -> tuple[float, list[dict]]:
    """(anchor GB, one row per level and layout)."""
    _, state = next(iter(synthetic_states(model, 0)))
    arrays = [t.reshape(-1).view(torch.int16).numpy() for t in state.values()]
    total = sum(a.nbytes for a in arrays)
    rows = []
    for level in levels:
        compressor = zstandard.ZstdCompressor(level=level)
        for layout in ("as stored", "byte-grouped"):
            t0 = time.perf_counter()
            blobs = [
                compressor.compress(a.tobytes() if layout == "as stored" else _grouped(a))
                for a in arrays
            ]
            encode_s = time.perf_counter() - t0
            size = sum(len(b) for b in blobs)
            decompressor = zstandard.ZstdDecompressor()
            t0 = time.perf_counter()
            for blob in blobs:
                decompressor.decompress(blob)
            decode_s = time.perf_counter() - t0
            rows.append(
                {
                    "level": level,
                    "layout": layout,
                    "ratio": size / total,
                    "encode_gbps": total / 1e9 / encode_s,
                    "decode_gbps": total / 1e9 / decode_s,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return total / 1e9, rows


def table(model: str, gigabytes: float, rows: list[dict]) -> str:
    lines = [
        f"### anchors of {model} ({gigabytes:.2f} GB bf16, std-0.02 init)",
        "| zstd level | layout | size vs plain | compress GB/s (1 thread) | decompress GB/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['level']} | {r['layout']} | {r['ratio']:.3f} | {r['encode_gbps']:.2f} | "
        f"{r['decode_gbps']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="anchor compression: plain vs zstd vs byte-grouped")
    ap.add_argument("--model", default="qwen3-100m", choices=sorted(SHAPES))
    ap.add_argument("--levels", type=zstd_level, nargs="+", default=[1, 3])
    ap.add_argument("--json", type=json_path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    gigabytes, rows = measure(args.model, args.levels)
    results = {"model": args.model, "anchor_gb": gigabytes, "rows": rows}
    report(table(args.model, gigabytes, rows), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
