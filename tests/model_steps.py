"""Test helpers: real AdamW steps on a model, TRL v1's delta writer, the Hub cache layout
(`from model_steps import ...`; the models themselves: `bench.models`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch


class AdamWLoop:
    """Real optimizer steps on a language-modelling loss over random token sequences."""

    def __init__(self, model: torch.nn.Module, lr: float, seed: int = 0):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (2, 32), generator=self.generator)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def trl_v1_write(path, version: int, base: dict, new: dict) -> None:
    """An independent writer of TRL v1's delta layout and string metadata."""
    tensors, changed, total_changed, total = {}, [], 0, 0
    for name, tensor in new.items():
        total += tensor.numel()
        mask = base[name].view(-1).view(torch.int16) != tensor.view(-1).view(torch.int16)
        indices = mask.nonzero().squeeze(1)
        if indices.numel():
            tensors[f"{name}.indices"] = indices.to(torch.int32)
            tensors[f"{name}.values"] = tensor.view(-1)[indices].contiguous()
            changed.append(name)
            total_changed += indices.numel()
    metadata = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "True",
        "model_version": str(version),
        "num_changed_params": str(len(changed)),
        "total_changed_elements": str(total_changed),
        "total_elements": str(total),
        "sparsity": f"{1 - total_changed / total:.6f}",
        "changed_params": json.dumps(changed),
    }
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def as_hub_cache(folder: Path, cache: Path, repo: str) -> Path:
    """`folder`'s files laid out as the Hub cache does (`models--org--name/blobs/<sha256>` and a
    snapshot folder of relative links into it); returns the snapshot folder."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / HUB_COMMIT
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        blob = repo_dir / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot
