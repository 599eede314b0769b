"""Codec benchmark on realistic bf16 RL deltas: sizes, bits per changed element, entropy floor,
and throughput (GB of model per second) for diff+encode and decode+apply.

Per optimizer step of `bench.realistic` (Qwen3-shaped model, AdamW, LM loss on Python
source):
- density = changed / total elements;
- bytes of the whole file for full bf16 (model bytes), `coo` and `packed` (`encode_delta`), and a
  plain reference encoder (per tensor: LEB128 gaps under zstd-3 + zigzag bit-pattern differences
  as LEB128 under zstd-3, numpy, one thread; payload only, no header);
- bits per changed element (file bytes * 8 / changed); for packed also the payload split
  (gaps / vals);
- entropy floor per changed element = index-set entropy + value entropy, where the index-set
  entropy is sum over tensors of log2 C(N_t, k_t) / k (lgamma; per-tensor counts are in the
  metadata) and the value entropy is the Shannon entropy of the int16 bit-pattern differences
  new - old over all changed elements. `idx_floor_global` = log2 C(N, k) / k with global N, k;
- throughput in GB of model (bf16 bytes of all parameters) per second: encode = Bf16Snapshot.diff
  (from the bf16 before/after states, digests included) + moving the full-state digest +
  encode_delta, also given without the diff (the codec alone), decode+apply =
  Replica.update(file bytes) on a replica holding the before-state (a `DictSink`, which writes
  a verified delta in place);
- `ref diff`: the same change scan in plain numpy (compare, flatnonzero, gathers, digests) on the
  same threads, the baseline for the compiled scan; it also cross-checks the diff element by
  element.

Usage:
  .venv/bin/python -m bench.codec --model qwen3-100m --steps 6 --lr 1e-6 \
      --cache /tmp/deltasync-bench --json bench/results/codec-qwen3-100m.json
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import psutil
import safetensors.torch
import torch
import zstandard

from deltasync.arguments import count, folder, json_path, learning_rate, whole
from deltasync.codec import encode_anchor, encode_delta
from deltasync.kernels.state_hash import apply_changes, state_sums
from deltasync.publisher.snapshot import WORKERS, Bf16Snapshot, Diff
from deltasync.replica.replica import Replica
from deltasync.wire.digests import tensor_digest, total

from .memory import PeakRss
from .models.qwen3 import SHAPES
from .output import best_of, report
from .realistic import bf16_states

RUN_ID = "bench"
LN2 = math.log(2.0)


# --- plain reference encoder (independent of deltasync.codec) ---------------------------------


def _leb128(values: np.ndarray) -> bytes:
    v = values.astype(np.uint64)
    if v.size == 0:
        return b""
    n = np.ones(v.size, np.int64)
    for k in range(1, 10):
        n += v >= np.uint64(1) << np.uint64(7 * k)
    start = np.cumsum(n) - n
    out = np.zeros(int(n.sum()), np.uint8)
    for k in range(int(n.max())):
        sel = np.flatnonzero(n > k)
        byte = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        byte |= (n[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[start[sel] + k] = byte.astype(np.uint8)
    return out.tobytes()


def reference_encode(diff: Diff, level: int = 3) -> dict[str, float]:
    """Bytes of gap and value streams of the reference encoder, and its wall time."""
    t0 = time.perf_counter()
    cz = zstandard.ZstdCompressor(level=level)
    idx_bytes = val_bytes = 0
    for change in diff.changes.values():
        idx = change.indices.numpy()
        gaps = np.diff(idx, prepend=-1) - 1
        d = change.values.view(torch.int16).numpy().astype(np.int32) - change.previous.view(
            torch.int16
        ).numpy().astype(np.int32)
        d = ((d + 32768) % 65536 - 32768).astype(np.int32)  # wrap to int16
        zz = ((d << 1) ^ (d >> 31)).astype(np.uint32)
        idx_bytes += len(cz.compress(_leb128(gaps)))
        val_bytes += len(cz.compress(_leb128(zz)))
    return {
        "idx_bytes": idx_bytes,
        "val_bytes": val_bytes,
        "bytes": idx_bytes + val_bytes,
        "s": time.perf_counter() - t0,
    }


def reference_diff(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], diff: Diff
) -> float:
    """Wall time of a plain numpy change scan (compare, flatnonzero, gathers, digests) over the
    same thread pool as `Bf16Snapshot.diff`: the baseline its compiled scan is measured against.
    Asserts that both found the same elements and values.
    """

    def one(name: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, str]:
        old = base[name].reshape(-1).view(torch.int16).numpy()
        cur = new[name].reshape(-1).view(torch.int16).numpy()
        where = np.flatnonzero(old != cur)
        return name, where, cur[where], old[where], tensor_digest(new[name])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        found = list(pool.map(one, base))
    elapsed = time.perf_counter() - t0
    for name, where, values, previous, digest in found:
        change = diff.changes.get(name)
        assert digest == diff.digests[name], name
        if change is None:
            assert where.size == 0, name
            continue
        assert np.array_equal(where, change.indices.numpy()), name
        assert np.array_equal(values, change.values.view(torch.int16).numpy()), name
        assert np.array_equal(previous, change.previous.view(torch.int16).numpy()), name
    return elapsed


# --- entropy floor ------------------------------------------------------------------------------


def _log2_binom(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / LN2


def entropy_floor(diff: Diff) -> dict[str, float]:
    k = diff.changed_elements
    n = diff.total_elements
    per_tensor = 0.0
    counts = np.zeros(65536, np.int64)
    for name, change in diff.changes.items():
        numel = int(np.prod(diff.shapes[name], dtype=np.int64))
        per_tensor += _log2_binom(numel, change.indices.numel())
        d = change.values.view(torch.int16).numpy() - change.previous.view(torch.int16).numpy()
        counts += np.bincount(d.view(np.uint16), minlength=65536)
    p = counts[counts > 0] / k
    val = float(-(p * np.log2(p)).sum())
    one_step = (counts[1] + counts[65535]) / k
    return {
        "idx_floor": per_tensor / k,
        "idx_floor_global": _log2_binom(n, k) / k,
        "val_floor": val,
        "floor": per_tensor / k + val,
        "frac_one_step": float(one_step),
    }


# --- the benchmark ------------------------------------------------------------------------------


def _payload_split(data: bytes) -> tuple[int, int]:
    tensors = safetensors.torch.load(data)
    gaps = sum(t.numel() for k, t in tensors.items() if k.endswith(".gaps"))
    vals = sum(t.numel() for k, t in tensors.items() if k.endswith(".vals"))
    return gaps, vals


def _encode_delta(
    diff: Diff, sums, *, version: int, encoding: str, base: dict[str, torch.Tensor] | None = None
) -> bytes:
    """What the publisher does per version: move the full-state digest, encode the delta
    (`ctx` against the base version's tensors, as the publisher's snapshot holds them)."""
    digest = total(apply_changes(sums, diff.changes))
    return encode_delta(
        diff,
        run_id=RUN_ID,
        version=version,
        base_version=version - 1,
        state_digest=digest,
        encoding=encoding,
        base=base,
    )


def _update(
    replica: Replica, data: bytes, base: int, repeat: int
) -> tuple[float, float, float, float]:
    """Replica.update(data), which is stage (decode, validate, verify digests) + apply (write).

    Returns (first stage's wall time plus the apply's, best stage time, the apply's time, best
    stage CPU time plus the apply's) over `repeat` stagings: staging mutates nothing, so it is
    repeated on the same replica, and the one apply comes last.
    """
    assert replica.version == base
    stage_s = first = cpu = math.inf
    staged = None
    for r in range(max(1, repeat)):
        c0, t0 = time.process_time(), time.perf_counter()
        staged = replica.stage([(data, None)])
        stage_s, cpu = min(stage_s, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        if r == 0:
            first = stage_s
    c0, t0 = time.process_time(), time.perf_counter()
    assert replica.commit(staged)
    apply_s, apply_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert replica.version == base + 1
    return first + apply_s, stage_s, apply_s, cpu + apply_cpu


def _train_step_s(info: dict, step: int) -> float | None:
    steps = info.get("step_s") or []
    return steps[step - 1] if len(steps) >= step else None


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state.items()}


def run(args: argparse.Namespace) -> dict:
    info: dict = {}
    rows = []
    load0 = os.getloadavg()
    snap = rep_ans = rep_ctx = rep_packed = rep_coo = sums = None
    model_bytes = 0
    for step, state in bf16_states(
        args.model,
        args.steps,
        lr=args.lr,
        seed=args.seed,
        batch=args.batch,
        seq=args.seq,
        cache=args.cache,
        info=info,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    ):
        if step == 0:
            model_bytes = sum(t.numel() * 2 for t in state.values())
            snap = Bf16Snapshot(_clone(state))
            sums = state_sums(state)
            anchor = encode_anchor(state, run_id=RUN_ID, version=1)  # versions start at 1
            rep_packed, rep_ans, rep_ctx = Replica(), Replica(), Replica()
            for replica in (rep_packed, rep_ans, rep_ctx):
                replica.update(anchor)
            if not args.no_coo_apply:
                rep_coo = Replica()
                rep_coo.update(anchor)
            del anchor
            continue
        gc.collect()
        # what the trainer holds besides its snapshot (sampling itself only: no /proc walk)
        with PeakRss(psutil.Process(), 0.05, tree=False) as rss:
            diff, diff_s, diff_cpu = best_of(partial(snap.diff, state), args.repeat)
            enc = partial(_encode_delta, diff, sums, version=step + 1)
            packed, enc_s, enc_cpu = best_of(partial(enc, encoding="packed"), args.repeat)
        coo, coo_enc_s, _ = best_of(partial(enc, encoding="coo"), args.repeat)
        apply_first_s, stage_s, commit_s, apply_cpu = _update(rep_packed, packed, step, args.repeat)
        apply_s = stage_s + commit_s
        gb, ent, k = model_bytes / 1e9, entropy_floor(diff), diff.changed_elements
        coded, alt = {}, {}  # the ans and ctx files; their figures
        for e, replica in (("ans", rep_ans), ("ctx", rep_ctx)):
            base = snap.tensors if e == "ctx" else None
            data, e_s, e_cpu = best_of(partial(enc, encoding=e, base=base), args.repeat)
            _, e_stage, e_commit, a_cpu = _update(replica, data, step, args.repeat)
            coded[e], a_s = data, e_stage + e_commit
            alt |= {
                f"{e}_bytes": len(data),
                f"{e}_bits": 8 * len(data) / k,
                f"{e}_vs_floor": 8 * len(data) / k / ent["floor"],
                f"{e}_encode_s": e_s,
                f"{e}_apply_s": a_s,
                f"{e}_stage_s": e_stage,
                f"{e}_commit_s": e_commit,
                f"{e}_encode_gbps": gb / (diff_s + e_s),
                f"{e}_codec_encode_gbps": gb / e_s,
                f"{e}_apply_gbps": gb / a_s,
                f"{e}_encode_gb_per_cpu_s": gb / (diff_cpu + e_cpu),
                f"{e}_apply_gb_per_cpu_s": gb / a_cpu,
            }
        ans, ctx = coded["ans"], coded["ctx"]
        sums = apply_changes(sums, diff.changes)
        coo_apply_s = None
        if rep_coo is not None:
            _, c_stage, c_commit, _ = _update(rep_coo, coo, step, args.repeat)
            coo_apply_s = c_stage + c_commit
        ref = reference_encode(diff)
        ref_diff_s = min(reference_diff(snap.tensors, state, diff) for _ in range(args.repeat))
        gaps_b, vals_b = _payload_split(packed)
        ans_gaps_b, ans_vals_b = _payload_split(ans)
        row = {
            "step": step,
            "density": diff.density,
            "changed": k,
            "total": diff.total_elements,
            "full_bytes": model_bytes,
            "coo_bytes": len(coo),
            "packed_bytes": len(packed),
            "packed_gaps_bytes": gaps_b,
            "packed_vals_bytes": vals_b,
            "packed_header_bytes": len(packed) - gaps_b - vals_b,
            "ref_bytes": ref["bytes"],
            "ref_idx_bytes": ref["idx_bytes"],
            "ref_val_bytes": ref["val_bytes"],
            "coo_bits": 8 * len(coo) / k,
            "packed_bits": 8 * len(packed) / k,
            "packed_idx_bits": 8 * gaps_b / k,
            "packed_val_bits": 8 * vals_b / k,
            "ref_bits": 8 * ref["bytes"] / k,
            **ent,
            "packed_vs_floor": 8 * len(packed) / k / ent["floor"],
            "packed_vs_ref": len(packed) / ref["bytes"],
            **alt,
            "ans_header_bytes": len(ans) - ans_gaps_b - ans_vals_b,
            "ans_idx_bits": 8 * ans_gaps_b / k,
            "ans_val_bits": 8 * ans_vals_b / k,
            "ans_vs_packed": len(ans) / len(packed),
            "ctx_vs_ans": len(ctx) / len(ans),
            "diff_s": diff_s,
            "encode_s": enc_s,
            "coo_encode_s": coo_enc_s,
            "apply_s": apply_s,
            "stage_s": stage_s,
            "commit_s": commit_s,
            "apply_first_s": apply_first_s,
            "coo_apply_s": coo_apply_s,
            "ref_encode_s": ref["s"],
            "ref_diff_s": ref_diff_s,
            "encode_gbps": model_bytes / 1e9 / (diff_s + enc_s),
            "diff_gbps": model_bytes / 1e9 / diff_s,
            "encode_only_gbps": model_bytes / 1e9 / enc_s,
            "apply_gbps": model_bytes / 1e9 / apply_s,
            "diff_cpu_s": diff_cpu,
            "encode_cpu_s": enc_cpu,
            "apply_cpu_s": apply_cpu,
            "encode_gb_per_cpu_s": model_bytes / 1e9 / (diff_cpu + enc_cpu),
            "apply_gb_per_cpu_s": model_bytes / 1e9 / apply_cpu,
            "transient_bytes": rss.extra,
            "snapshot_bytes": model_bytes,
            "train_step_s": _train_step_s(info, step),
        }
        rows.append(row)
        print(
            f"step {step}: density {100 * diff.density:.3f} %, ctx {row['ctx_bits']:.2f} "
            f"({row['ctx_vs_ans']:.3f}x ans) / ans {row['ans_bits']:.2f} / packed "
            f"{row['packed_bits']:.2f} bits/changed (floor {ent['floor']:.2f}), diff {diff_s:.2f}s "
            f"encode ans {alt['ans_encode_s']:.2f}s / packed {enc_s:.2f}s, apply ans "
            f"{alt['ans_apply_s']:.2f}s / "
            f"packed {apply_s:.2f}s",
            file=sys.stderr,
            flush=True,
        )
        snap.advance(diff)
        del diff, packed, coo, ans, ctx
    return {
        "model": args.model,
        "shape": SHAPES[args.model].__dict__,
        "params": info.get("params"),
        "model_bytes": model_bytes,
        "lr": args.lr,
        "seed": args.seed,
        "batch": args.batch,
        "seq": args.seq,
        "repeat": args.repeat,
        "source": info.get("source"),
        "train_loss": info.get("loss"),
        "train_step_s": info.get("step_s"),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "rows": rows,
    }


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def markdown(res: dict) -> str:
    rows = res["rows"]
    out = [
        f"### {res['model']}: {res['params'] / 1e6:.0f}M params, "
        f"{res['model_bytes'] / 1e9:.3f} GB bf16, lr {res['lr']:g}, batch "
        f"{res['batch']}x{res['seq']}",
        "",
        "Whole files (header included) side by side: `ans`, `packed` (the default before it), "
        "`coo` (TRL v1), against the entropy floor:",
        "",
        "| step | density | ans MB | packed MB | coo MB | ans b/chg (idx+val) | packed b/chg | "
        "floor b/chg (idx+val) | ans/floor | packed/floor | ans/packed | ans header KB | "
        "ans encode GB/s (diff+enc) | ans encode GB/s (enc) | ans decode+apply GB/s | "
        "packed encode GB/s | packed decode+apply GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['step']} | {100 * r['density']:.2f} % | {_mb(r['ans_bytes'])} | "
            f"{_mb(r['packed_bytes'])} | {_mb(r['coo_bytes'])} | {r['ans_bits']:.2f} "
            f"({r['ans_idx_bits']:.2f}+{r['ans_val_bits']:.2f}) | {r['packed_bits']:.2f} | "
            f"{r['floor']:.2f} ({r['idx_floor']:.2f}+{r['val_floor']:.2f}) | "
            f"{r['ans_vs_floor']:.3f} | {r['packed_vs_floor']:.3f} | {r['ans_vs_packed']:.3f} | "
            f"{r['ans_header_bytes'] / 1e3:.1f} | {r['ans_encode_gbps']:.2f} | "
            f"{r['ans_codec_encode_gbps']:.2f} | {r['ans_apply_gbps']:.2f} | "
            f"{r['encode_gbps']:.2f} | {r['apply_gbps']:.2f} |"
        )
    out += [
        "",
        "`ctx` (positions and value steps per exponent group of the base element) against `ans` "
        "on the same steps:",
        "",
        "| step | density | ctx MB | ans MB | ctx/ans | ctx b/chg | ans b/chg | floor b/chg "
        "(per tensor) | ctx/floor | ctx encode GB/s (diff+enc) | ctx encode GB/s (enc) | "
        "ans encode GB/s (enc) | ctx decode+apply GB/s | ans decode+apply GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['step']} | {100 * r['density']:.2f} % | {_mb(r['ctx_bytes'])} | "
            f"{_mb(r['ans_bytes'])} | {r['ctx_vs_ans']:.3f} | {r['ctx_bits']:.2f} | "
            f"{r['ans_bits']:.2f} | {r['floor']:.2f} | {r['ctx_vs_floor']:.3f} | "
            f"{r['ctx_encode_gbps']:.2f} | {r['ctx_codec_encode_gbps']:.2f} | "
            f"{r['ans_codec_encode_gbps']:.2f} | {r['ctx_apply_gbps']:.2f} | "
            f"{r['ans_apply_gbps']:.2f} |"
        )
    ans_med = {
        k: statistics.median(r[k] for r in rows)
        for k in ("ans_encode_gbps", "ans_codec_encode_gbps", "ans_apply_gbps", "ans_vs_floor")
    }
    out += [
        "",
        f"ans: worst step {max(r['ans_vs_floor'] for r in rows):.3f}x the floor (median "
        f"{ans_med['ans_vs_floor']:.3f}); median encode {ans_med['ans_encode_gbps']:.2f} GB/s "
        f"with the diff ({ans_med['ans_codec_encode_gbps']:.2f} without), "
        f"decode+apply {ans_med['ans_apply_gbps']:.2f} GB/s.",
        "",
        "The `packed` encoding in detail (as measured before `ans`):",
        "",
        "| step | density | full MB | coo MB | packed MB | ref MB | coo b/chg | packed b/chg "
        "(idx+val) | ref b/chg | floor b/chg (idx+val) | idx floor global | packed/floor "
        "| packed/ref | full/packed | ±1 step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['step']} | {100 * r['density']:.2f} % | {_mb(r['full_bytes'])} | "
            f"{_mb(r['coo_bytes'])} | {_mb(r['packed_bytes'])} | {_mb(r['ref_bytes'])} | "
            f"{r['coo_bits']:.1f} | {r['packed_bits']:.2f} ({r['packed_idx_bits']:.2f}+"
            f"{r['packed_val_bits']:.2f}) | {r['ref_bits']:.2f} | {r['floor']:.2f} "
            f"({r['idx_floor']:.2f}+{r['val_floor']:.2f}) | {r['idx_floor_global']:.2f} | "
            f"{r['packed_vs_floor']:.3f} | {r['packed_vs_ref']:.3f} | "
            f"{r['full_bytes'] / r['packed_bytes']:.0f}x | {100 * r['frac_one_step']:.0f} % |"
        )
    out += [
        "",
        "| step | diff s | ref diff s (numpy) | packed encode s | encode GB/s (diff+enc) | "
        "diff GB/s | enc GB/s | "
        "decode+apply s (stage+apply) | decode+apply GB/s | first update s | coo encode s | "
        "coo decode+apply s | "
        "ref encode s (1 thread) | encode GB/cpu-s | decode+apply GB/cpu-s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        coo_apply = "-" if r["coo_apply_s"] is None else f"{r['coo_apply_s']:.2f}"
        out.append(
            f"| {r['step']} | {r['diff_s']:.2f} | {r['ref_diff_s']:.2f} | {r['encode_s']:.2f} | "
            f"{r['encode_gbps']:.2f} | "
            f"{r['diff_gbps']:.2f} | {r['encode_only_gbps']:.2f} | {r['apply_s']:.2f} "
            f"({r['stage_s']:.2f}+{r['commit_s']:.2f}) | "
            f"{r['apply_gbps']:.2f} | {r['apply_first_s']:.2f} | {r['coo_encode_s']:.2f} | "
            f"{coo_apply} | "
            f"{r['ref_encode_s']:.2f} | {r['encode_gb_per_cpu_s']:.2f} | "
            f"{r['apply_gb_per_cpu_s']:.2f} |"
        )
    out += [
        "",
        "Trainer side (the diff runs on the training thread inside `send_weights`; encode and "
        "upload run in the publisher's thread):",
        "",
        "| step | optimizer step s | diff s (blocking) | diff / step | diff+encode s | "
        "(diff+encode) / step | snapshot MB (kept) | peak extra MB during diff+encode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step_s, blocking, total = r.get("train_step_s"), r["diff_s"], r["diff_s"] + r["encode_s"]
        shares = [f"{100 * s / step_s:.1f} %" if step_s else "-" for s in (blocking, total)]
        out.append(
            f"| {r['step']} | {f'{step_s:.1f}' if step_s else '-'} | {blocking:.2f} | "
            f"{shares[0]} | {total:.2f} | {shares[1]} | {_mb(r['snapshot_bytes'])} | "
            f"{_mb(r['transient_bytes'])} |"
        )
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "encode_gbps",
            "apply_gbps",
            "packed_vs_floor",
            "packed_bits",
            "encode_gb_per_cpu_s",
            "apply_gb_per_cpu_s",
        )
    }
    best = {k: max(r[k] for r in rows) for k in ("encode_gbps", "apply_gbps")}
    steps = res.get("train_step_s") or []
    out += [
        "",
        f"median: encode {med['encode_gbps']:.2f} GB/s, decode+apply {med['apply_gbps']:.2f} "
        f"GB/s (per CPU-second: {med['encode_gb_per_cpu_s']:.2f} / "
        f"{med['apply_gb_per_cpu_s']:.2f}; best step: {best['encode_gbps']:.2f} / "
        f"{best['apply_gbps']:.2f} GB/s), diff "
        f"{statistics.median(r['ref_diff_s'] / r['diff_s'] for r in rows):.1f}x faster than "
        f"the numpy reference, packed {med['packed_bits']:.2f} bits/changed, "
        "packed/floor "
        f"{med['packed_vs_floor']:.3f}; timings: best of {res['repeat']}; train step "
        + (f"{statistics.median(steps):.1f} s (median of {len(steps)})" if steps else "n/a")
        + f"; source: {res['source']}; threads {res['torch_threads']}/{res['cpus']} cpus; "
        f"load average {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="deltasync codec benchmark on realistic deltas")
    ap.add_argument("--model", default="qwen3-100m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=count, default=6)
    ap.add_argument("--lr", type=learning_rate, default=1e-6)
    ap.add_argument("--seed", type=whole, default=0)
    ap.add_argument("--batch", type=count, default=2)
    ap.add_argument("--seq", type=count, default=128)
    ap.add_argument(
        "--cache",
        type=folder,
        default=None,
        help="folder for generated steps (train once, replay later); default: live",
    )
    ap.add_argument(
        "--repeat",
        type=count,
        default=3,
        help="time each operation this many times and keep the best (default 3)",
    )
    ap.add_argument("--json", type=json_path, default=None, help="write results as JSON here")
    ap.add_argument(
        "--no-coo-apply",
        action="store_true",
        help="skip the second replica that times coo decode+apply (saves memory)",
    )
    args = ap.parse_args(argv)
    res = run(args)
    report(markdown(res), res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
