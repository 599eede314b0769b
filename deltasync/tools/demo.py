"""`python -m deltasync demo`: the whole protocol on one machine in a minute, no servers needed.

A small fp32 language model takes AdamW steps on text shipped with Python; after each step the
publisher diffs its bf16 view, uploads a delta (and anchors by policy) to a local bucket in the
background, and a replica catches up from the bucket and is checked bitwise against the trainer.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import open_store
from deltasync.wire.policy import AnchorPolicy

log = logging.getLogger("deltasync.tools.demo")


class TinyLM(torch.nn.Module):
    """Byte-level two-layer MLP language model (~2.4M parameters, std-0.02 init)."""

    def __init__(self, context: int = 8, width: int = 256, hidden: int = 1024):
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(256, width)
        self.up = torch.nn.Linear(context * width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.head = torch.nn.Linear(width, 256, bias=False)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.02)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        windows = tokens.unfold(1, self.context + 1, 1)  # (batch, positions, context + 1)
        x = self.embed(windows[..., :-1]).flatten(2)
        logits = self.head(torch.relu(self.down(torch.relu(self.up(x)))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[..., -1].flatten())


def _corpus() -> torch.Tensor:
    """Bytes of the standard library's own source: real text that every Python install ships."""
    text = Path(logging.__file__).read_bytes() + Path(torch.nn.modules.linear.__file__).read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def run_demo(bucket: str, steps: int, lr: float, encoding: str, seed: int = 0) -> int:
    """Train, publish and follow `steps` versions; returns the number of mismatches (0 expected)."""
    torch.manual_seed(seed)
    model, corpus = TinyLM(), _corpus()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    store = open_store(bucket)
    run_id = f"demo-{int(time.time())}"
    config = PublisherConfig(run_id=run_id, encoding=encoding, policy=AnchorPolicy(interval=10))
    replica, mismatches = Replica(), 0
    with Publisher(store, config) as publisher:
        for version in range(1, steps + 1):
            if version > 1:
                starts = torch.randint(0, corpus.numel() - 129, (4,))
                batch = torch.stack([corpus[s : s + 129] for s in starts.tolist()])
                model.loss(batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            record = publisher.publish(model).result(timeout=120)
            for line in record.log_lines(bucket):
                log.info("%s", line)
            started = time.perf_counter()
            replica.sync(store)
            expected = Bf16Snapshot.capture(model).tensors
            same = all(
                torch.equal(replica.tensors[n].view(torch.int16), t.view(torch.int16))
                for n, t in expected.items()
            )
            mismatches += not same
            log.info(
                "replica at version %d: %s (%.3fs)",
                replica.version,
                "bitwise equal to the trainer" if same else "MISMATCH",
                time.perf_counter() - started,
            )
    log.info("done: %d versions of run %s in %s, %d mismatches", steps, run_id, bucket, mismatches)
    return mismatches
