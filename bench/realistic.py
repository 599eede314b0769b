"""Realistic bf16 weight deltas: a Qwen3-shaped model trained with AdamW on Python source text.

What it reproduces (see shared/notes/targets.md): std-0.02 init, fp32 master weights, AdamW
(no weight decay) at an RL-sized learning rate (default 1e-6) on a real language-modelling loss,
and the bf16 view of every parameter after each optimizer step. The model is built from a
`transformers.Qwen3Config` (no download); the text is the installed Python stdlib's own `.py`
source, tokenized byte-level (token id = byte value, so only the first 256 ids are ever inputs;
with tied embeddings the LM head still trains every vocabulary row).

Shapes: `bench.models.qwen3.SHAPES`, selectable by name (`qwen3-1.7b` is too slow to train
here: use `synthetic` steps).

API:
- `bf16_states(...)` yields `(step, state)`: step 0 is the initial bf16 view, then one per
  optimizer step. `state` is a dict name -> bf16 CPU tensor that is REUSED (overwritten in place)
  on the next iteration: copy what you keep. Tied aliases are skipped (as `named_parameters`).
- `deltas(...)` yields one `deltasync.kernels.changes.Diff` per optimizer step
  (Bf16Snapshot.diff, then advance), holding one snapshot and one bf16 state besides the trainer.
- With `cache=DIR`, training runs once and writes `state0.safetensors` (full bf16) plus one sparse
  `stepNNNN.safetensors` per step (`<name>.idx` int32/int64 ascending flat indices,
  `<name>.val` bf16 new values) under DIR/<key>/; later calls replay from disk without training.

CLI: `python -m bench.realistic --model qwen3-100m --steps 6 --cache /tmp/deltasync-bench`
trains (or checks) the cache and prints per-step loss, density and step time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from deltasync.arguments import count, folder, learning_rate, whole

from .models.qwen3 import SHAPES, build_model

__all__ = ["bf16_states", "deltas"]


def corpus_tokens(max_bytes: int = 32 << 20) -> np.ndarray:
    """Byte-level tokens (int64, values 0..255) of the stdlib's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 20:
        raise RuntimeError(f"only {total} bytes of Python source under {root}")
    return np.frombuffer(b"".join(chunks), np.uint8).astype(np.int64)


class _Trainer:
    """AdamW (no weight decay) on next-byte prediction over random windows of the corpus."""

    def __init__(self, model_name: str, *, lr: float, seed: int, batch: int, seq: int):
        from deltasync.publisher.snapshot import named_tensors

        self.model = build_model(model_name, seed=seed)
        self.params = named_tensors(self.model)
        adamw = dict(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        try:
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw, fused=True)
        except (RuntimeError, TypeError):
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw, foreach=True)
        self.tokens = torch.from_numpy(corpus_tokens())
        self.rng = np.random.default_rng(seed)
        self.batch, self.seq = batch, seq

    def step(self) -> tuple[float, float]:
        """One optimizer step; returns (loss, seconds)."""
        t0 = time.perf_counter()
        starts = self.rng.integers(0, self.tokens.numel() - self.seq, self.batch)
        ids = torch.stack([self.tokens[s : s + self.seq] for s in starts])
        out = self.model(input_ids=ids, labels=ids)  # HF shifts labels: seq-1 next-byte targets
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(out.loss.detach()), time.perf_counter() - t0

    def bf16_into(self, state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if state is None:
            return {n: p.detach().to(torch.bfloat16).clone() for n, p in self.params}
        with torch.no_grad():
            for n, p in self.params:
                state[n].copy_(p)  # fp32 -> bf16 round-to-nearest-even, as bf16_view
        return state


def _cache_dir(
    cache: str | os.PathLike, model: str, lr: float, seed: int, batch: int, seq: int
) -> Path:
    return Path(cache) / f"{model}-lr{lr:g}-s{seed}-b{batch}x{seq}"


def _read_meta(d: Path) -> dict | None:
    try:
        return json.loads((d / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def ensure_cache(
    cache: str | os.PathLike,
    model: str = "qwen3-100m",
    steps: int = 6,
    *,
    lr: float = 1e-6,
    seed: int = 0,
    batch: int = 2,
    seq: int = 128,
    log=print,
) -> Path:
    """Train and write the cache unless it already holds >= `steps` steps; returns its folder.

    A shorter cache is regenerated from scratch (the optimizer state is not cached).
    """
    import safetensors.torch

    from deltasync.publisher.snapshot import Bf16Snapshot

    d = _cache_dir(cache, model, lr, seed, batch, seq)
    meta = _read_meta(d)
    if meta is not None and meta.get("steps", 0) >= steps:
        return d
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    trainer = _Trainer(model, lr=lr, seed=seed, batch=batch, seq=seq)
    n_params = sum(p.numel() for _, p in trainer.params)
    log(
        f"[realistic] {model}: {n_params / 1e6:.1f}M params, built in "
        f"{time.perf_counter() - t0:.1f}s; training {steps} steps at lr {lr:g} "
        f"(batch {batch}x{seq}, {torch.get_num_threads()} threads)"
    )
    state = trainer.bf16_into(None)
    safetensors.torch.save_file(state, str(d / "state0.safetensors"))
    snap = Bf16Snapshot({n: t.clone() for n, t in state.items()})
    meta = {
        "model": model,
        "shape": asdict(SHAPES[model]),
        "params": n_params,
        "lr": lr,
        "seed": seed,
        "batch": batch,
        "seq": seq,
        "steps": 0,
        "loss": [],
        "step_s": [],
        "density": [],
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=1))
    for k in range(1, steps + 1):
        loss, step_s = trainer.step()
        state = trainer.bf16_into(state)
        diff = snap.diff(state)
        snap.advance(diff)
        payload = {}
        for name, ch in diff.changes.items():
            idx = ch.indices
            if int(np.prod(diff.shapes[name])) <= 2**31 - 1:
                idx = idx.to(torch.int32)
            payload[f"{name}.idx"] = idx.contiguous()
            payload[f"{name}.val"] = ch.values.contiguous()
        safetensors.torch.save_file(payload, str(d / f"step{k:04d}.safetensors"))
        meta["steps"] = k
        meta["loss"].append(loss)
        meta["step_s"].append(step_s)
        meta["density"].append(diff.density)
        (d / "meta.json").write_text(json.dumps(meta, indent=1))
        log(
            f"[realistic] step {k}: loss {loss:.4f}, density {100 * diff.density:.3f} %, "
            f"train step {step_s:.1f}s"
        )
    del trainer, snap
    return d


def _replay(d: Path, steps: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    import safetensors.torch

    state = safetensors.torch.load_file(str(d / "state0.safetensors"))
    yield 0, state
    for k in range(1, steps + 1):
        payload = safetensors.torch.load_file(str(d / f"step{k:04d}.safetensors"))
        for key, idx in payload.items():
            if key.endswith(".idx"):
                name = key[:-4]
                state[name].view(-1)[idx.to(torch.int64)] = payload[f"{name}.val"]
        del payload
        yield k, state


def bf16_states(
    model: str = "qwen3-100m",
    steps: int = 6,
    *,
    lr: float = 1e-6,
    seed: int = 0,
    batch: int = 2,
    seq: int = 128,
    cache: str | os.PathLike | None = None,
    log=print,
    info: dict | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(0, initial bf16 state), then (k, bf16 state after optimizer step k) for k = 1..steps.

    The yielded dict is reused and overwritten in place on the next iteration. `info`, when
    given, is filled with params / loss / step_s / source ("cache" or "live").
    """
    info = {} if info is None else info
    if cache is not None:
        d = ensure_cache(cache, model, steps, lr=lr, seed=seed, batch=batch, seq=seq, log=log)
        meta = _read_meta(d) or {}
        info.update(
            source=f"cache {d}",
            params=meta.get("params"),
            loss=meta.get("loss"),
            step_s=meta.get("step_s"),
        )
        yield from _replay(d, steps)
        return
    trainer = _Trainer(model, lr=lr, seed=seed, batch=batch, seq=seq)
    info.update(source="live", params=sum(p.numel() for _, p in trainer.params), loss=[], step_s=[])
    state = trainer.bf16_into(None)
    yield 0, state
    for k in range(1, steps + 1):
        loss, step_s = trainer.step()
        info["loss"].append(loss)
        info["step_s"].append(step_s)
        log(f"[realistic] step {k}: loss {loss:.4f}, train step {step_s:.1f}s")
        yield k, trainer.bf16_into(state)


def deltas(model: str = "qwen3-100m", steps: int = 6, **kwargs) -> Iterator:
    """One `deltasync.publisher.snapshot.Diff` per optimizer step (exact bitwise bf16 changes)."""
    from deltasync.publisher.snapshot import Bf16Snapshot

    snap = None
    for k, state in bf16_states(model, steps, **kwargs):
        if k == 0:
            snap = Bf16Snapshot({n: t.clone() for n, t in state.items()})
            continue
        diff = snap.diff(state)
        snap.advance(diff)
        yield diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-100m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=count, default=6)
    ap.add_argument("--lr", type=learning_rate, default=1e-6)
    ap.add_argument("--seed", type=whole, default=0)
    ap.add_argument("--batch", type=count, default=2)
    ap.add_argument("--seq", type=count, default=128)
    ap.add_argument(
        "--cache", type=folder, default=None, help="cache folder (default: train live, no cache)"
    )
    ap.add_argument("--threads", type=count, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(lr=args.lr, seed=args.seed, batch=args.batch, seq=args.seq)
    if args.cache:
        d = ensure_cache(args.cache, args.model, args.steps, **kw)
        meta = _read_meta(d)
        print(json.dumps({k: meta[k] for k in ("params", "steps", "loss", "step_s", "density")}))
        return 0
    for i, diff in enumerate(deltas(args.model, args.steps, **kw), 1):
        print(
            f"step {i}: density {100 * diff.density:.3f} % "
            f"({diff.changed_elements}/{diff.total_elements})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
