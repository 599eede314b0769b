"""The trainer side of `bench.chaos`, one process the soak kills and restarts.

It trains a tiny Qwen3 (AdamW on random tokens) and publishes every step (at most one version
past the soak's `--gate`, as a trainer that syncs its replicas keeps pace) through a folder bucket
whose every attempt may fail (a reset connection, a full disk) or stall, from a seeded schedule.
It journals each committed version with the full-state digest of the weights it published (the
soak's truth for what replicas must serve) and each fault it injected. With `--takeover` it
continues the bucket's run from its last committed weights; a `Fenced` commit (another publisher
took the run) ends it with status 3.

    python -m bench.chaos_trainer --bucket B --model M --journal J --versions 200 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from deltasync.errors import Fenced, PublishError
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import bf16_view
from deltasync.store import LocalStore, RetryPolicy
from deltasync.wire.policy import AnchorPolicy
from trainer.resume import BucketWeights, load_into

RUN_ID = "chaos"
ENCODINGS = ("ctx", "ans", "packed", "coo")
FENCED_EXIT = 3
_KINDS = ("reset", "disk full", "stall", "answer lost")


class Journal:
    """Append-only JSON lines, each flushed and fsynced: what survives a SIGKILL."""

    def __init__(self, path: str):
        self._file = open(path, "a")  # noqa: SIM115 (kept open for the process's life)

    def write(self, **entry: object) -> None:
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


class ChaosStore(LocalStore):
    """A folder bucket whose writes and reads fail or stall at `rate`, seeded: each attempt
    draws a connection reset, ENOSPC, a 0.2 s stall, a lost answer (done, then reset) or
    nothing."""

    def __init__(self, folder: str, journal: Journal, rate: float, seed: int):
        super().__init__(folder, retry=RetryPolicy(attempts=3, backoff_s=0.02))
        self.journal, self.rate, self.random = journal, rate, random.Random(seed)

    def _call(self, what: str, path: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        if what not in ("put", "swap", "get", "delete"):
            return super()._call(what, path, fn, *args, **kwargs)

        def attempt(*a: object, **k: object) -> object:
            kind = self._draw(what)
            if kind == "answer lost":  # the operation happened, its answer did not arrive
                fn(*a, **k)
                raise ConnectionResetError(errno.ECONNRESET, "answer lost (injected)")
            return fn(*a, **k)

        return super()._call(what, path, attempt, *args, **kwargs)

    def _draw(self, what: str) -> str | None:
        """This attempt's fault (raised here, except a lost answer), or None."""
        draw = self.random.random()
        if draw >= self.rate:
            return None
        kind = _KINDS[int(len(_KINDS) * draw / self.rate)]
        self.journal.write(fault=f"store {what}: {kind}")
        if kind == "reset":
            raise ConnectionResetError(errno.ECONNRESET, "connection reset (injected)")
        if kind == "disk full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if kind == "stall":
            time.sleep(0.2)
        return kind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bucket", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--versions", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-rate", type=float, default=0.03)
    p.add_argument("--takeover", action="store_true")
    p.add_argument(
        "--gate",
        default=None,
        help="a file holding the newest version the soak has synced: publish at most one past it",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    journal = Journal(args.journal)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    store = ChaosStore(args.bucket, journal, args.fault_rate, args.seed)
    config = PublisherConfig(
        RUN_ID,
        encoding=ENCODINGS[args.seed % len(ENCODINGS)],  # each restart another encoding
        policy=AnchorPolicy(interval=10, max_delta_fraction=None, keep_anchors=2),
        takeover=args.takeover,
    )
    publisher = Publisher(store, config)
    try:
        publisher.claim()
    except PublishError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.takeover and (weights := BucketWeights.read(store, RUN_ID)) is not None:
        load_into(model, weights)
        publisher.resume_from(weights.replica)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    trained = False
    while (publisher.committed_version or 0) < args.versions:
        _wait_for_gate(args.gate, publisher.committed_version or 0)
        if trained:  # the first publish after a (re)start sends the weights as they are
            tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trained = True
        digest = full_state_digest({n: bf16_view(t) for n, t in model.named_parameters()})
        try:
            record = publisher.publish(model).result(timeout=300)
        except Fenced as exc:
            print(f"fenced: {exc}", file=sys.stderr)
            return FENCED_EXIT
        except PublishError as exc:  # the store gave up: the next publish retries the version
            journal.write(fault="publish failed", error=str(exc)[:200])
            continue
        journal.write(version=record.version, digest=digest.hex(), encoding=config.encoding)
    publisher.close(timeout=300)
    return 0


def _wait_for_gate(gate: str | None, committed: int, timeout_s: float = 600.0) -> None:
    """Keep pace with the replicas, as a trainer that syncs them every step does."""
    deadline = time.monotonic() + timeout_s
    while gate and time.monotonic() < deadline:
        path = Path(gate)
        with contextlib.suppress(ValueError):  # replaced atomically: never half written
            if (int(path.read_text()) if path.exists() else 0) >= committed:
                return
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
