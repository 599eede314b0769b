"""`python -m bench`: the quick codec benchmark (payload and speed per step, in about a minute).

    python -m bench                                   # Qwen3-100M shape, 4 steps at lr 1e-6
    python -m bench --model qwen3-tiny --steps 2      # seconds; what the tests run
    python -m bench --model qwen3-0.6b --json out.json

It trains a Qwen3-shaped model at an RL learning rate and prints, per step, the payload (full /
coo / packed / entropy floor) and the diff, encode and apply times, then the trainer-side cost.
The full benchmark, with more options, is `python -m bench.codec` (BENCHMARKS.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import codec

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.codec` with this command's defaults (flags given later win)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return codec.main(["--steps", "4", "--repeat", "1", *argv])


if __name__ == "__main__":
    sys.exit(main())
