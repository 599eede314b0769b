"""`ctx` against `ans` where the realistic codec benchmark does not look (issue 32's bounds).

- **Heavy-tailed, per-tensor-scaled weights**: the tensor shapes of one Qwen3-0.6B layer plus a
  16,384-row slice of its embedding and a norm, each drawn from a Student-t (3 degrees of
  freedom: tails like a trained checkpoint's) times a per-tensor scale between 1e-3 and 1e-1,
  then moved by an Adam-sized step (about `lr` per element, the sign of a random gradient).
- **A late step**: the bf16 deltas of `bench.realistic` after `--steps` AdamW steps (the
  realistic table stops at step 6; Adam's moments and the exponents have settled by step 50).

Sizes are the coded payloads (`ans`: both streams per tensor; `ctx`: the blob) for the synthetic
weights, and whole files for the late steps.

Usage:
  .venv/bin/python -m bench.ctx_bounds --model qwen3-100m --steps 52 \
      --cache /tmp/deltasync-bench --json bench/results/ctx-bounds.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from deltasync.arguments import count, folder, json_path
from deltasync.codec import ans, ctx, encode_delta
from deltasync.kernels.changes import TensorChange
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.snapshot import Bf16Snapshot

from .models.qwen3 import SHAPES
from .output import report
from .realistic import bf16_states

LAYER = {
    "q_proj": (2048, 1024),
    "k_proj": (1024, 1024),
    "o_proj": (1024, 2048),
    "gate_proj": (3072, 1024),
    "down_proj": (1024, 3072),
    "embed_tokens (rows)": (16384, 1024),
    "norm": (1024,),
}


def _change(base: torch.Tensor, new: torch.Tensor) -> TensorChange:
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    idx = torch.nonzero(flat_base.view(torch.int16) != flat_new.view(torch.int16)).reshape(-1)
    return TensorChange(idx, flat_new[idx], flat_base[idx])


def heavy_tailed(lr: float, shrink: int = 1, seed: int = 0) -> dict:
    """ctx / ans payload bytes of one Adam-sized step on Student-t weights (every dimension
    of the shapes divided by `shrink`)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the Student-t sampler draws from the global generator
    ctx_bytes = ans_bytes = changed = total = 0
    for name, full in LAYER.items():
        shape = tuple(n // shrink for n in full)
        scale = 10 ** (-3 + 2 * torch.rand((), generator=gen).item())
        t_dist = torch.distributions.StudentT(torch.tensor(3.0))
        weights = t_dist.sample(shape) * scale
        if name == "norm":
            weights = 1.0 + 0.1 * weights
        gradient = torch.randn(shape, generator=gen)
        step = lr * gradient / (gradient.abs() + 0.5)  # about lr, with the gradient's sign
        base, new = weights.bfloat16(), (weights + step).bfloat16()
        change = _change(base, new)
        if not change.indices.numel():
            continue
        rows = (0, shape[0])
        ctx_bytes += ctx.encode_tensor(change, base, shape, rows).size
        ans_bytes += sum(v.numel() for v in ans.encode_changes({name: change}).values())
        changed, total = changed + change.indices.numel(), total + base.numel()
    return {"lr": lr, "density": changed / total, "ctx_vs_ans": ctx_bytes / ans_bytes}


def late_steps(model: str, steps: int, lr: float, cache: str | None) -> list[dict]:
    """ctx / ans whole files at the last two of `steps` realistic AdamW steps."""
    rows, snap = [], None
    for step, state in bf16_states(model, steps, lr=lr, cache=cache, log=_log):
        if snap is None:
            snap = Bf16Snapshot({n: t.clone() for n, t in state.items()})
            continue
        diff = snap.diff(state)
        if step >= steps - 1:
            sizes = {}
            for encoding in ("ans", "ctx"):
                data = encode_delta(
                    diff,
                    run_id="bench",
                    version=step + 1,
                    base_version=step,
                    state_digest=full_state_digest(state),
                    encoding=encoding,
                    base=snap.tensors,
                )
                sizes[encoding] = len(data)
            rows.append(
                {"step": step, "density": diff.density, "ctx_vs_ans": sizes["ctx"] / sizes["ans"]}
                | {f"{k}_bytes": v for k, v in sizes.items()}
            )
        snap.advance(diff)
    return rows


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def markdown(res: dict) -> str:
    out = [
        "| weights | step | lr | density | ctx / ans |",
        "|---|---|---|---|---|",
    ]
    for r in res["heavy_tailed"]:
        out.append(
            f"| Student-t (3), per-tensor scales 1e-3..1e-1 | one Adam-sized | {r['lr']:g} | "
            f"{100 * r['density']:.2f} % | {r['ctx_vs_ans']:.3f} |"
        )
    for r in res["late"]:
        out.append(
            f"| {res['model']} (bench.realistic) | {r['step']} | {res['lr']:g} | "
            f"{100 * r['density']:.2f} % | {r['ctx_vs_ans']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ctx against ans: heavy tails and a late step")
    ap.add_argument("--model", default="qwen3-100m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=count, default=52)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--cache", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    ap.add_argument("--shrink", type=count, default=1, help="divide the synthetic shapes")
    args = ap.parse_args(argv)
    res = {
        "model": args.model,
        "steps": args.steps,
        "lr": args.lr,
        "heavy_tailed": [heavy_tailed(lr, args.shrink) for lr in (1e-6, 3e-6)],
        "late": late_steps(args.model, args.steps, args.lr, args.cache),
    }
    report(markdown(res), res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
