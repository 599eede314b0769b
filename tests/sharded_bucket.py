"""Sharded versions written in one process as two FSDP2 ranks would (`from sharded_bucket import
...`): part files of a small three-tensor model, and a bucket of them committed by hand."""

from __future__ import annotations

from pathlib import Path

import torch

from deltasync.codec import ParsedFile, PartInfo, encode_anchor, encode_delta
from deltasync.kernels.changes import Diff, TensorChange
from deltasync.kernels.state_hash import apply_changes, tensor_sum
from deltasync.store import LocalStore
from deltasync.wire.digests import StateDigest, bytes_digest, total
from deltasync.wire.manifest import MANIFEST_PATH, ChainEntry, Manifest, PartRef, file_path

SHAPES = {"embed.weight": (17, 8), "norm.weight": (5,), "proj.weight": (3, 4)}
SPLIT = {"embed.weight": 9, "norm.weight": 3, "proj.weight": 3}  # rank 1 holds no proj rows


def state_at(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def rows_of(rank: int) -> dict[str, tuple[int, int]]:
    return {n: (0, SPLIT[n]) if rank == 0 else (SPLIT[n], SHAPES[n][0]) for n in SHAPES}


def block_sums(state, rank):
    out = {}
    for name, (start, stop) in rows_of(rank).items():
        row = state[name][0].numel() if state[name].dim() > 1 else 1
        out[name] = tensor_sum(name, state[name][start:stop], start=start * row)
    return out


def anchor_parts(state, version=1, run_id="r"):
    parts = []
    for rank in (0, 1):
        rows = rows_of(rank)
        block = {n: state[n][a:b].clone() for n, (a, b) in rows.items()}
        parts.append(
            encode_anchor(
                block,
                run_id=run_id,
                version=version,
                state_digest=total(block_sums(state, rank)),
                part=PartInfo(rank, 2, rows),
                shapes=SHAPES,
            )
        )
    return tuple(parts)


def delta_parts(old, new, version=2, encoding="packed", run_id="r"):
    parts = []
    for rank in (0, 1):
        rows = rows_of(rank)
        changes = {}
        for name, (a, b) in rows.items():
            row = old[name][0].numel() if old[name].dim() > 1 else 1
            flat_old, flat_new = old[name].reshape(-1), new[name].reshape(-1)
            lo, hi = a * row, b * row
            moved = flat_old[lo:hi].view(torch.int16) != flat_new[lo:hi].view(torch.int16)
            idx = torch.nonzero(moved).flatten() + lo
            if idx.numel():
                changes[name] = TensorChange(idx, flat_new[idx], flat_old[idx])
        sums = apply_changes(block_sums(old, rank), changes)
        diff = Diff(changes, {}, dict(SHAPES))
        parts.append(
            encode_delta(
                diff,
                run_id=run_id,
                version=version,
                base_version=version - 1,
                state_digest=total(sums),
                encoding=encoding,
                part=PartInfo(rank, 2, rows),
            )
        )
    return tuple(parts)


def step(state, seed):
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in state.items()}
    for t in new.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 4)]
        flat[idx] = (flat[idx].float() + 0.5).to(torch.bfloat16)
    return new


def write_sharded_bucket(root: Path, versions: int = 4, run_id: str = "r") -> list[dict]:
    """A bucket of `versions` sharded versions (an anchor at 1, deltas after); returns the
    state at each version (index 0: version 1)."""
    store = LocalStore(str(root))
    states = [state_at(0)]
    for seed in range(1, versions):
        states.append(step(states[-1], seed))

    def entry(kind: str, version: int, parts: tuple[bytes, ...], changed: int) -> ChainEntry:
        refs = []
        for index, data in enumerate(parts):
            digest = bytes_digest(data)
            path = file_path(run_id, kind, version, digest, (index, len(parts)))
            store.put(path, data)
            part_digest = ParsedFile.parse(data).meta.state_digest.hex()
            refs.append(PartRef(path, len(data), digest, part_digest))
        whole = StateDigest.zero()
        for ref in refs:
            whole = whole + StateDigest.parse(ref.state_digest)
        size = sum(r.bytes for r in refs)
        encoding = "full" if kind == "anchor" else "packed"
        return ChainEntry(
            version, kind, None, size, None, encoding, changed, whole.hex(), tuple(refs)
        )

    elements = sum(t.numel() for t in states[0].values())
    anchor = entry("anchor", 1, anchor_parts(states[0], run_id=run_id), elements)
    manifest = Manifest(run_id, 1, (anchor,), (), anchor.bytes)
    for version in range(2, versions + 1):
        old, new = states[version - 2], states[version - 1]
        changed = sum(
            int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in old
        )
        parts = delta_parts(old, new, version=version, run_id=run_id)
        manifest = manifest.with_version([entry("delta", version, parts, changed)], 2)
    store.publish(MANIFEST_PATH, manifest.to_json())
    return states
