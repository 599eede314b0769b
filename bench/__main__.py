"""`python -m bench`: the quick codec benchmark (payload and speed per step, in about a minute).

    python -m bench                                   # Qwen3-100M shape, 4 steps at lr 1e-6
    python -m bench --model qwen3-tiny --steps 2      # seconds; what the tests run
    python -m bench --model qwen3-0.6b --json out.json

It trains a Qwen3-shaped model at an RL learning rate and prints, per step, the payload (full /
coo / packed / entropy floor) and the diff, encode and apply times, then the trainer-side cost.
The full benchmark, with more options, is `python -m bench.codec` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deltasync.arguments import count, folder, json_path, learning_rate

from . import codec

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="qwen3-100m",
        choices=("qwen3-tiny", "qwen3-100m", "qwen3-0.6b"),
        help="shape (default qwen3-100m: ~2 min on 2 cores; qwen3-0.6b: ~8 min)",
    )
    p.add_argument("--steps", type=count, default=4, help="optimizer steps (default 4)")
    p.add_argument(
        "--lr", type=learning_rate, default=1e-6, help="AdamW learning rate (default 1e-6)"
    )
    p.add_argument("--repeat", type=count, default=1, help="timings: best of N (default 1)")
    p.add_argument(
        "--cache", type=folder, default=None, help="keep the trained steps here for re-runs"
    )
    p.add_argument(
        "--json", type=json_path, default=None, help="also write the results as JSON here"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    forwarded = ["--model", args.model, "--steps", str(args.steps), "--lr", str(args.lr)]
    forwarded += ["--repeat", str(args.repeat)]
    forwarded += ["--cache", args.cache] if args.cache else []
    forwarded += ["--json", args.json] if args.json else []
    return codec.main(forwarded)


if __name__ == "__main__":
    sys.exit(main())
