"""Continuing a run after a restart, without forking it.

`--takeover` continues the bucket's run with the weights it last committed (loaded into the
model before training; a fresh optimizer). `--resume` also restores the optimizer, scheduler and
rollout position from a TRL checkpoint in `--output-dir` - only from one whose weights are, bf16
bit for bit, the bucket's last committed version: resuming from any other would publish versions
that differ from the ones replicas already serve.
"""

from __future__ import annotations

import re
from pathlib import Path

import safetensors.torch
import torch

from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.publisher.snapshot import bf16_view
from deltasync.replica.replica import Replica
from deltasync.store import Store
from deltasync.wire.manifest import read_manifest

__all__ = ["BucketWeights", "latest_checkpoint", "load_into"]

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class BucketWeights:
    """The bf16 state of the bucket's latest version of a run (replayed and verified). The
    replica holding it goes on to the publisher (`Publisher.resume_from`), so the chain is
    downloaded once, not once for the model and again for the publisher's snapshot."""

    def __init__(self, run_id: str, replica: Replica):
        assert replica.version is not None
        self.run_id, self.version, self.replica = run_id, replica.version, replica
        self.tensors: dict[str, torch.Tensor] = dict(replica.tensors)

    @classmethod
    def read(cls, store: Store, run_id: str) -> BucketWeights | None:
        """The run's latest weights, or None when the bucket holds another run or none."""
        manifest = read_manifest(store)
        if manifest is None or manifest.run_id != run_id:
            return None
        replica = Replica()
        replica.sync(store)
        return cls(run_id, replica)

    def check_checkpoint(self, checkpoint: Path) -> None:
        """Refuse, in one line, a checkpoint whose weights are not this version's."""
        saved = _checkpoint_weights(checkpoint)
        differ = [
            name
            for name, tensor in self.tensors.items()
            if name not in saved
            or not torch.equal(bf16_view(saved[name]).view(torch.int16), tensor.view(torch.int16))
        ]
        if differ:
            raise SystemExit(
                f"error: {checkpoint} does not hold version {self.version} of run {self.run_id} "
                f"({len(differ)} of {len(self.tensors)} tensors differ, e.g. {differ[0]}); "
                "resuming from it would fork the run: resume from the checkpoint saved with that "
                "version, or drop --resume to continue from the bucket's weights with a fresh "
                "optimizer (--takeover)"
            )


def latest_checkpoint(output_dir: str) -> Path:
    """TRL's newest `checkpoint-<step>` folder in `output_dir`."""
    found = [
        (int(m.group(1)), p)
        for p in Path(output_dir).glob("checkpoint-*")
        if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()
    ]
    if not found:
        raise SystemExit(
            f"error: --resume found no TRL checkpoint in {output_dir} (save them with "
            "--save-steps N); --takeover alone continues from the bucket's weights"
        )
    return max(found)[1]


def load_into(model: torch.nn.Module, weights: BucketWeights) -> None:
    """Copy the bucket's weights (checkpoint names) into the model's parameters (bf16 widens
    exactly); a checkpoint tensor held inside a fused in-memory one is written through its view."""
    params = {
        ckpt: view
        for ckpt, view in CheckpointNames.of(model).apply(
            (n, p.data) for n, p in model.named_parameters()
        )
    }
    missing = sorted(set(weights.tensors) - set(params))
    if missing:
        raise SystemExit(
            f"error: run {weights.run_id} holds tensors this model lacks ({missing[:3]}); "
            "continue it with the model it was trained from"
        )
    with torch.no_grad():
        for name, tensor in weights.tensors.items():
            params[name].copy_(tensor)


def _checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise SystemExit(f"error: {checkpoint} has no model*.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(safetensors.torch.load_file(str(file)))
    return weights
