"""`DictSink` writes a verified delta into the held tensors at commit, and only then.

Staging (decode, validate, verify) leaves the held bytes untouched; the commit scatters the changes
in place (no post-update copy of the touched tensors); an anchor replaces the tensors; several
files in one update chain through the states in between.
"""

from __future__ import annotations

import torch

from deltasync.codec import encode_anchor, encode_delta
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.replica.replica import Replica

RUN = "run-dict-sink"


def _states(steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 states where each step changes a few elements of one tensor and none of another."""
    gen = torch.Generator().manual_seed(0)
    state = {
        "a.weight": torch.randn(64, 32, generator=gen).bfloat16(),
        "b.weight": torch.randn(16, generator=gen).bfloat16(),
    }
    states = [state]
    for step in range(steps):
        state = {n: t.clone() for n, t in state.items()}
        flat = state["a.weight"].view(-1)
        picked = torch.randperm(flat.numel(), generator=gen)[:40]
        flat[picked] += 0.25 * (step + 1)
        states.append(state)
    return states


def _files(states: list[dict[str, torch.Tensor]]) -> list[bytes]:
    files = [encode_anchor(states[0], run_id=RUN, version=1)]
    snapshot = Bf16Snapshot({n: t.clone() for n, t in states[0].items()})
    for version, state in enumerate(states[1:], start=2):
        diff = snapshot.diff(state)
        files.append(
            encode_delta(
                diff,
                run_id=RUN,
                version=version,
                base_version=version - 1,
                state_digest=full_state_digest(state),
                base=snapshot.tensors,
            )
        )
        snapshot.advance(diff)
    return files


def _bits(tensors) -> dict[str, bytes]:
    return {n: t.view(torch.int16).numpy().tobytes() for n, t in tensors.items()}


def test_delta_is_written_in_place_at_commit_only() -> None:
    states = _states(1)
    anchor, delta = _files(states)
    replica = Replica()
    replica.update(anchor)
    held = dict(replica.tensors)
    staged = replica.stage([(delta, None)])
    assert _bits(replica.tensors) == _bits(states[0])  # staging wrote nothing
    assert replica.commit(staged)
    assert _bits(replica.tensors) == _bits(states[1])
    assert all(replica.tensors[n] is held[n] for n in held)  # no copies: the same tensors


def test_anchor_then_deltas_in_one_update_chain_bitwise() -> None:
    states = _states(3)
    files = _files(states)
    replica = Replica()
    assert replica.commit(replica.stage([(f, None) for f in files])) == [1, 2, 3, 4]
    assert _bits(replica.tensors) == _bits(states[-1])
    assert replica.state_digest == full_state_digest(states[-1])
