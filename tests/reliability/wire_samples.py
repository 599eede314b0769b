"""Valid wire files made by the real library, and helpers to compare a replica's state bitwise.

A small synthetic model (three bf16 tensors) keeps thousands of fuzz inputs cheap; the files are
exactly what `Publisher` would write for it (`encode_anchor` / `encode_delta` on real diffs).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec import encode_anchor, encode_delta
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig, SyncRecord
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica
from deltasync.store import Store
from deltasync.wire.digests import tensor_digest
from deltasync.wire.policy import AnchorPolicy

RUN = "run"
SHAPES = {"a.weight": (32, 16), "b.bias": (40,), "c.weight": (8, 8)}

State = dict[str, torch.Tensor]


def base_state(seed: int = 0) -> State:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator).bfloat16() for n, s in SHAPES.items()}


def stepped(
    state: State, seed: int, *, fraction: float = 0.05, skip: tuple[str, ...] = ()
) -> State:
    """A copy of `state` with about `fraction` of the elements of each tensor moved one bf16 ulp
    or more (`skip` tensors stay unchanged, so deltas also carry untouched tensors)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in state.items():
        new = tensor.clone()
        if name not in skip:
            bits = new.view(-1).view(torch.int16).numpy()
            picked = np.flatnonzero(rng.random(bits.size) < fraction)
            if picked.size == 0:
                picked = np.array([int(rng.integers(bits.size))])
            bits[picked] += rng.integers(1, 4, picked.size).astype(np.int16)
        out[name] = new
    return out


@dataclass(frozen=True)
class Chain:
    """Versions 1..n of one run: `states[v]`, an anchor for every version, deltas per encoding."""

    run_id: str
    states: dict[int, State]
    anchors: dict[int, bytes]
    deltas: dict[tuple[str, int], bytes]

    @property
    def latest(self) -> int:
        return max(self.states)


def build_chain(
    versions: int = 4, *, run_id: str = RUN, seed: int = 0, skip: tuple[str, ...] = ("c.weight",)
) -> Chain:
    states = {1: base_state(seed)}
    for v in range(2, versions + 1):
        states[v] = stepped(states[v - 1], seed * 1000 + v, skip=skip)
    anchors = {v: encode_anchor(s, run_id=run_id, version=v) for v, s in states.items()}
    deltas = {}
    for v in range(2, versions + 1):
        diff = Bf16Snapshot({n: t.clone() for n, t in states[v - 1].items()}).diff(states[v])
        for encoding in ("ans", "ctx", "packed", "coo"):
            deltas[encoding, v] = encode_delta(
                diff,
                run_id=run_id,
                version=v,
                base_version=v - 1,
                state_digest=full_state_digest(states[v]),
                encoding=encoding,
                base=states[v - 1],
            )
    return Chain(run_id, states, anchors, deltas)


def replica_at(chain: Chain, version: int | None) -> Replica:
    """A fresh replica holding `version` of the chain (None: empty), without touching the chain."""
    replica = Replica()
    if version is not None:
        replica.sink.state = {n: t.clone() for n, t in chain.states[version].items()}
        replica.run_id, replica.version = chain.run_id, version
    return replica


def fingerprint(replica: Replica) -> tuple[object, ...]:
    """Everything a refused input must leave unchanged: run, version and every tensor's bytes."""
    return (
        replica.run_id,
        replica.version,
        tuple(
            (n, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for n, t in sorted(replica.tensors.items())
        ),
    )


def bitwise_equal(tensors: State, expected: State) -> bool:
    return tensors.keys() == expected.keys() and all(
        tuple(tensors[n].shape) == tuple(t.shape)
        and torch.equal(tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected.items()
    )


def digests(tensors: State) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in tensors.items()}


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header JSON object, data section) of a well-formed safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: object, data: bytes, *, pad: bool = True) -> bytes:
    """A safetensors file from any JSON value as header (padded to 8 bytes like safetensors)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def publish_chain(
    store: Store,
    chain: Chain,
    *,
    policy: AnchorPolicy | None = None,
    encoding: str = "packed",
    versions: range | None = None,
) -> list[SyncRecord]:
    """Publish the chain's states through the real `Publisher` (waiting for each commit); a
    range of versions after the first continues the bucket's run (a takeover)."""
    config = PublisherConfig(
        run_id=chain.run_id,
        encoding=encoding,
        policy=policy or AnchorPolicy(interval=3, max_delta_fraction=None, keep_anchors=2),
        takeover=versions is not None and versions.start > 1,
    )
    with Publisher(store, config) as publisher:
        return [
            publisher.publish(chain.states[v]).result(timeout=60)
            for v in versions or range(1, chain.latest + 1)
        ]
