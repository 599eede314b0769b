"""What the full-state digest costs: its O(changed) update per delta against a full xxh3 pass and
a full digest recompute, on one synthetic step of a Qwen3 shape.

    python -m bench.state_digest                              # qwen3-0.6b, 2 % density
    python -m bench.state_digest --model qwen3-tiny --repeat 1
    python -m bench.state_digest --json bench/results/state-digest-qwen3-0.6b.json

Timed (best of `--repeat`, wall and CPU seconds of all threads, `deltasync.kernels.changes.WORKERS`
threads):
- `xxh3 pass`: xxh3-128 of every tensor's bf16 bytes (what the trainer's diff and an anchor's
  check cost; a delta's check hashes every tensor it touches, nearly all of them at 2 %);
- `digest recompute`: `cubesum-4x31` over every element (bootstrap, anchors, every N versions);
- `digest update`: the O(changed) move from the changed elements' previous and new values (what
  the publisher and every replica do per version).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from deltasync.arguments import count, fraction, json_path
from deltasync.kernels.changes import WORKERS
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.wire.digests import tensor_digest, total

from .models.qwen3 import SHAPES
from .output import best_of, report
from .synthetic import synthetic_states

__all__ = ["main"]


def measure(model: str, *, density: float, repeat: int) -> dict:
    states = synthetic_states(model, 1, density=density)
    _, state = next(states)
    snapshot = Bf16Snapshot({n: t.clone() for n, t in state.items()})
    _, state = next(states)
    diff = snapshot.diff(state)
    before = state_sums(snapshot.tensors)

    def xxh3_pass() -> list[str]:
        with ThreadPoolExecutor(WORKERS) as pool:
            return list(pool.map(tensor_digest, state.values()))

    rows = {}
    for label, fn in (
        ("xxh3 pass", xxh3_pass),
        ("digest recompute", lambda: state_sums(state)),
        ("digest update", lambda: apply_changes(before, diff.changes)),
    ):
        result, wall, cpu = best_of(fn, repeat)
        rows[label] = {"wall_s": wall, "cpu_s": cpu}
        if label == "digest recompute":
            recomputed = total(result)
        if label == "digest update":
            updated = total(result)
    if updated != recomputed:
        raise AssertionError(f"O(changed) update {updated} != full recompute {recomputed}")
    return {
        "model": model,
        "params": diff.total_elements,
        "bf16_bytes": 2 * diff.total_elements,
        "changed": diff.changed_elements,
        "density": diff.density,
        "workers": WORKERS,
        "rows": rows,
    }


def render(result: dict) -> str:
    rows = result["rows"]
    update = rows["digest update"]["wall_s"]
    lines = [
        f"### {result['model']}: {result['params'] / 1e6:.0f}M params, "
        f"{result['bf16_bytes'] / 1e9:.3f} GB bf16, {result['changed'] / 1e6:.2f}M changed "
        f"({100 * result['density']:.2f} % density, sparsity {1 - result['density']:.4f}), "
        f"{result['workers']} threads",
        "",
        "| pass | wall s | CPU s | digest update is |",
        "|---|---:|---:|---:|",
    ]
    for label, row in rows.items():
        ratio = "-" if label == "digest update" else f"{update / row['wall_s']:.2f}x"
        lines.append(f"| {label} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.state_digest", description=__doc__)
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--density", type=fraction, default=0.02, help="changed share (default 0.02)")
    p.add_argument("--repeat", type=count, default=3, help="best of N (default 3)")
    p.add_argument(
        "--json", type=json_path, default=None, help="also write the results as JSON here"
    )
    args = p.parse_args(argv)
    result = measure(args.model, density=args.density, repeat=args.repeat)
    report(render(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
