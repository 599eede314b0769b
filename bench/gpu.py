"""The prepared GPU check: what a GPU trainer and a GPU replica pay per version, bit for bit.

    PYTHONPATH=. python -m bench.gpu --json gpu.json          # cuda: qwen3-0.6b and qwen3-1.7b
    PYTHONPATH=. python -m bench.gpu --device cpu --small      # qwen3-micro, 2 steps: CI dry run

`--device cuda` means the current CUDA device as its tensors report it (`cuda:0`), so the device
snapshot's device check compares like with like. One warm-up step per shape (`--warmup`, which
compiles the host loops and warms the allocator) runs first and is not reported.

`scripts/gpu_check.sh` runs it on a bare single-GPU machine. It needs torch, numpy, numba, xxhash,
safetensors and transformers only (no vLLM, no zstandard, no TRL: deltas use the default `ctx`
encoding, the replica's parameters are vLLM-shaped stand-ins). Per model shape, over `--steps`
real AdamW steps (fp32 master weights on the device, LM loss on random tokens, batch 2 x 128):
- the optimizer step's time;
- blocking change detection: the device mode (a bf16 reference on the device, only changed
  elements copied out; what the training thread waits for, `start_diff`, and apart the
  publisher's worker's share, the copies and split) against the host-snapshot mode (every
  parameter copied to the host as bf16, then the compiled scan); both diffs must be equal bit
  for bit;
- the full-state digest moved in O(changed) (what the publisher's worker does per version) and
  the per-tensor digests hashed off the training thread;
- encode (`ctx`, against the host snapshot of the base version, and `ans` beside it for the
  ratio), then the replica's stage (decode: `ctx` classes the base elements where the replica's
  parameters live, in bounded chunks; verify against host copies) and apply (the pause: changed
  elements written in place into fused qkv / gate_up parameters on the device);
  afterwards every served parameter equals the trainer's bf16 view bit for bit.
Any failed check raises; the result (JSON) says `"checks": "ok"` and `"ok": true` otherwise
(part 1 of `scripts/gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial

import torch

from deltasync.arguments import count, learning_rate, whole
from deltasync.codec import encode_anchor, encode_delta
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.snapshot import Bf16Snapshot, digests_after
from deltasync.replica.replica import Replica
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.wire.digests import total

from .gpu_common import GPU_SHAPES, part_main, shape_of, timed
from .gpu_detect import differing
from .models.qwen3 import build_config
from .models.vllm_layout import StandInQwen3, standin_layout

__all__ = ["main"]

RUN_ID = "gpu-check"


def _served_equals(standin: torch.nn.Module, trainer: torch.nn.Module) -> None:
    """Every served row holds the trainer's bf16 view, bit for bit (compared on the device)."""
    served = dict(standin.named_parameters(remove_duplicate=False))
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}
    layout = standin_layout(standin.config)({n: tuple(t.shape) for n, t in bf16.items()})
    for name, placement in layout.exact().items():
        flat = served[placement.param_name].data.view(-1)
        run = flat[placement.offset : placement.offset + placement.box.numel]
        want = bf16[name].reshape(-1).view(torch.int16)
        assert torch.equal(run.view(torch.int16), want), f"served {name}"


def run(
    model: str, device: torch.device, steps: int, lr: float, seed: int, warmup: int = 1
) -> dict:
    from transformers import Qwen3ForCausalLM

    config = build_config(shape_of(model))
    torch.manual_seed(seed)
    with torch.device(device):
        trainer = Qwen3ForCausalLM(config).float()
        standin = StandInQwen3(config)
    params = sum(p.numel() for p in trainer.parameters())
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)

    def optimizer_step() -> None:
        tokens = torch.randint(0, config.vocab_size, (2, 128), generator=generator).to(device)
        trainer(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    host = Bf16Snapshot.capture(trainer)
    on_device = DeviceSnapshot(
        Bf16Snapshot({n: t.clone() for n, t in host.tensors.items()}), device
    )
    sums = state_sums(host.tensors)
    replica = Replica(InPlaceSink(standin, standin_layout(config)))
    anchor = encode_anchor(host.tensors, run_id=RUN_ID, version=1, state_digest=total(sums))
    replica.update(anchor)
    _served_equals(standin, trainer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for step in range(1 - warmup, steps + 1):  # steps < 1 warm up and are not reported
        if step == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        version = step + warmup
        _, step_s = timed(device, optimizer_step)
        want, host_s = timed(device, host.diff, trainer, digests=False)
        finish, device_s = timed(device, on_device.start_diff, trainer, digests=False)
        diff, device_worker_s = timed(device, finish)  # the publisher's worker's share
        assert not (bad := differing(diff, want)), f"device and host diffs differ: {bad}"
        new_sums, digest_s = timed(device, apply_changes, sums, diff.changes)
        hashes, hashes_s = timed(device, digests_after, host.tensors, diff)
        diff = type(diff)(diff.changes, hashes, diff.shapes)
        encode = partial(
            encode_delta,
            diff,
            run_id=RUN_ID,
            version=version + 1,
            base_version=version,
            state_digest=total(new_sums),
        )
        data, encode_s = timed(device, encode, encoding="ctx", base=host.tensors)
        ans_data, encode_ans_s = timed(device, encode, encoding="ans")
        staged, stage_s = timed(device, replica.stage, [(data, None)])
        applied, apply_s = timed(device, replica.commit, staged)
        assert applied and replica.version == version + 1, "the replica did not take the version"
        _served_equals(standin, trainer)
        host.advance(want)
        on_device.advance(diff)
        sums = new_sums
        if step < 1:
            continue
        rows.append(
            {
                "step": step,
                "density": diff.density,
                "optimizer_step_s": step_s,
                "detect_host_snapshot_s": host_s,
                "detect_device_s": device_s,
                "detect_device_worker_s": device_worker_s,
                "digest_update_s": digest_s,
                "tensor_digests_worker_s": hashes_s,
                "encode_ctx_s": encode_s,
                "encode_ans_s": encode_ans_s,
                "delta_bytes": len(data),
                "ans_delta_bytes": len(ans_data),
                "replica_stage_s": stage_s,
                "replica_apply_s": apply_s,
            }
        )
        print(
            f"{model} step {step}: density {100 * diff.density:.2f} %, optimizer step "
            f"{step_s:.3f} s, detect host {host_s:.3f} s / device {device_s:.3f} s, apply "
            f"{apply_s:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "model": model,
        "params": params,
        "bf16_bytes": 2 * params,
        "steps": rows,
        "median": median,
        "peak_device_bytes": peak,
    }


def _gb(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e9:.1f} GB"  # None: not measured (CPU)


def table(result: dict) -> str:
    """Per step on each model, medians: what BENCHMARKS.md's "GPU figures" shows (part 1)."""

    def size(params: int) -> str:
        return f"{params / 1e6:.0f}M" if params < 1e9 else f"{params / 1e9:.2f}B"

    models = result["models"]
    med = [m["median"] for m in models]
    rows = {
        "density (median)": [f"{100 * x['density']:.2f} %" for x in med],
        "optimizer step": [f"{x['optimizer_step_s']:.3f} s" for x in med],
        "change detection, host-snapshot mode": [
            f"{x['detect_host_snapshot_s']:.3f} s" for x in med
        ],
        "change detection, device mode: blocking / worker": [
            f"{x['detect_device_s']:.3f} / {x['detect_device_worker_s']:.3f} s" for x in med
        ],
        "digest update / per-tensor digests (worker)": [
            f"{x['digest_update_s']:.3f} / {x['tensor_digests_worker_s']:.3f} s" for x in med
        ],
        "encode (`ans`)": [f"{x['encode_ans_s']:.3f} s" for x in med],
        "delta": [f"{x['delta_bytes'] / 1e6:.1f} MB" for x in med],
        "replica stage / apply (the pause)": [
            f"{x['replica_stage_s']:.3f} / {x['replica_apply_s']:.3f} s" for x in med
        ],
        "peak device memory": [_gb(m["peak_device_bytes"]) for m in models],
    }
    head = " | ".join(f"{m['model']} ({size(m['params'])})" for m in models)
    lines = [f"| per step | {head} |", "|---|" + "---:|" * len(models)]
    lines += [f"| {name} | {' | '.join(cells)} |" for name, cells in rows.items()]
    return "\n".join(lines)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=GPU_SHAPES)
    p.add_argument("--steps", type=count, default=3, help="reported steps (after the warm-up)")
    p.add_argument("--warmup", type=whole, default=1, help="unreported steps first")
    p.add_argument("--lr", type=learning_rate, default=1e-6)
    p.add_argument("--seed", type=whole, default=0)


def _run(args: argparse.Namespace, part, device: torch.device) -> bool:
    if args.small:  # qwen3-micro, 2 steps (the CI dry run)
        args.models, args.steps = ["qwen3-micro"], min(args.steps, 2)
    models = [run(m, device, args.steps, args.lr, args.seed, args.warmup) for m in args.models]
    part.update(models=models, checks="ok")  # any failed check raised
    return True


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu", __doc__, _run, argv, _options, table)


if __name__ == "__main__":
    sys.exit(main())
