"""A newcomer's first run: `launch.py --local` twice in a fresh clone (no compiled loops cached,
no model built), its console as printed, the versions each replica applied or skipped, and the
commit-to-serving latency of the first run against the second's.

    python -m bench.first_run --json bench/results/first-run.json

The clone is made from this checkout's HEAD and run with this interpreter (the clone's own
files come first on its path, so nothing is imported or cached from this checkout).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.output import report
from deltasync.arguments import json_path

REPO = Path(__file__).resolve().parent.parent
_OUTCOMES = re.compile(
    r"^(vllm-\d+): (\d+) versions applied and verified, (\d+) superseded, (\d+) failed$"
)
_LATENCY = re.compile(r"commit-to-serving latency p50 / p95: vllm-0 ([\d.]+) / ([\d.]+) s")


def run_once(clone: Path, name: str) -> dict:
    """One `launch.py --local` in `clone`; what its console said."""
    argv = [sys.executable, "launch.py", "--local", "--run-name", name]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=clone, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    lines = proc.stdout.splitlines()
    outcomes = {
        m.group(1): {
            "applied": int(m.group(2)),
            "superseded": int(m.group(3)),
            "failed": int(m.group(4)),
        }
        for m in map(_OUTCOMES.match, lines)
        if m
    }
    latency = _LATENCY.search(proc.stdout)
    return {
        "wall_s": round(wall, 1),
        "replicas": outcomes,
        "latency_p50_s": float(latency.group(1)) if latency else None,
        "latency_p95_s": float(latency.group(2)) if latency else None,
        "console": lines,
    }


def table(result: dict) -> str:
    """The two runs side by side, as BENCHMARKS.md shows them."""
    rows = [
        "| run | wall | vllm-0: applied / superseded / failed | latency p50 / p95 |",
        "|---|---|---|---|",
    ]
    what = {
        "first": "first (compiles the codec's loops while the replica starts)",
        "second": "second (everything cached)",
    }
    for run, label in what.items():
        r = result[run]
        counts = r["replicas"]["vllm-0"]
        outcome = f"{counts['applied']} / {counts['superseded']} / {counts['failed']}"
        latency = f"{r['latency_p50_s']} / {r['latency_p95_s']} s"
        rows.append(f"| {label} | {r['wall_s']} s | {outcome} | {latency} |")
    return "\n".join(rows) + f"\n\np95 first / second: {result['p95_first_over_second']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.first_run", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--json", type=json_path, required=True, help="where to write the result")
    args = p.parse_args(argv)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="deltasync-first-run-") as tmp:
        clone = Path(tmp) / "deltasync"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        first = run_once(clone, "first")
        second = run_once(clone, "second")
    ratio = None
    if first["latency_p95_s"] and second["latency_p95_s"]:
        ratio = round(first["latency_p95_s"] / second["latency_p95_s"], 2)
    result = {
        "command": "python -m bench.first_run --json " + str(args.json),
        "what": "launch.py --local twice in a fresh clone of HEAD: the first run compiles the "
        "codec's loops (python -m deltasync warm-up, while the replica starts) and builds the "
        "model; the second finds both cached",
        "commit": head,
        "first": first,
        "second": second,
        "p95_first_over_second": ratio,
    }
    report(table(result), result, str(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
