"""The project's rANS (`codec.rans`) against `constriction`, on the streams a `ctx` delta codes.

Issue 32 asks for the entropy coder to be chosen on measurement: keep `codec.rans` or use a
maintained library such as `constriction` (Rust-backed ANS with per-symbol categorical models),
whichever is faster at equal bytes. Both code the same symbols: the integer streams (skips and
value codes per exponent group) of the `ctx` delta of one realistic step (`bench.realistic`),
split as `codec.rans` splits them (an integer below 32 is its own symbol, a larger one the
escape symbol of its bit length plus that many bits less one, raw), with no raw low bits, so
that only the entropy coding differs. `codec.rans`: static 14-bit tables, two interleaved
states, tables and escape bits included in its bytes. `constriction`: `stack.AnsCoder` with a
`Categorical` model of each stream's own symbol frequencies (`perfect=False`, its fast
variant), escape bits added, its model not counted (built in both timings, as `codec.rans`
writes and reads its tables). One thread, best of `--repeat`.

`constriction` is not a dependency of the project; install it to run this:
  .venv/bin/pip install constriction==0.5.0
  .venv/bin/python -m bench.entropy_coders --model qwen3-0.6b --lr 3e-6 --step 6 \
      --cache /tmp/deltasync-bench --json bench/results/entropy-coders.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from deltasync.arguments import count, folder, json_path, learning_rate
from deltasync.codec import ctx
from deltasync.codec.rans import DIRECT, decode_integers, encode_integers
from deltasync.publisher.snapshot import Bf16Snapshot

from .models.qwen3 import SHAPES
from .output import best_of, report
from .realistic import bf16_states


def ctx_streams(model: str, lr: float, step: int, cache: str | None) -> list[np.ndarray]:
    """The integer streams (gaps, vals per group, every changed tensor) of step `step`'s delta."""
    base = None
    for k, state in bf16_states(model, step, lr=lr, cache=cache, log=lambda m: None):
        if k == step - 1:
            base = Bf16Snapshot({n: t.clone() for n, t in state.items()})
        if k == step:
            break
    assert base is not None
    diff = base.diff(state)
    streams = []
    for name, change in diff.changes.items():
        grid = ctx.Grid.of(diff.shapes[name])
        rows = (0, grid.rows)
        blob = ctx.encode_tensor(change, base.tensors[name], diff.shapes[name], rows)
        cuts, start, skips, codes = ctx._streams(
            torch.from_numpy(blob), change.indices.numel(), grid, rows
        )
        for g in range(cuts.size + 1):
            lo, hi = start[g, 0], start[g, -1]
            if hi > lo:
                streams += [skips[lo:hi].copy(), codes[lo:hi].copy()]
    return streams


def symbols(values: np.ndarray) -> tuple[np.ndarray, int]:
    """(symbols as `codec.rans` splits `values` with no raw low bits, escape bits in all)."""
    length = np.zeros(values.size, np.int64)
    high = values >= DIRECT
    big = values[high]
    guess = np.floor(np.log2(big.astype(np.float64))).astype(np.int64) + 1  # off by one near 2**k
    guess -= (big >> (guess - 1)) == 0
    guess += (big >> guess) != 0
    length[high] = guess
    out = np.where(high, DIRECT - 6 + length, values).astype(np.int32)
    return out, int((length[high] - 1).sum())


def compare(streams: list[np.ndarray], repeat: int) -> dict:
    import constriction  # optional: only this benchmark needs it

    split = [symbols(v) for v in streams]
    n = sum(v.size for v in streams)
    escape_bytes = sum(bits for _, bits in split) / 8
    entropy = escape_bytes
    for s, _ in split:
        p = np.bincount(s) / s.size
        p = p[p > 0]
        entropy -= s.size * float((p * np.log2(p)).sum()) / 8

    ours, ours_enc, _ = best_of(lambda: [encode_integers(v, 0) for v in streams], repeat)
    decoded, ours_dec, _ = best_of(
        lambda: [decode_integers(b, v.size, "stream") for b, v in zip(ours, streams, strict=True)],
        repeat,
    )
    assert all(np.array_equal(d, v) for d, v in zip(decoded, streams, strict=True))

    def models() -> list:
        out = []
        for s, _ in split:
            counts = np.bincount(s, minlength=max(2, int(s.max()) + 1)).astype(np.float64)
            out.append(constriction.stream.model.Categorical(counts / counts.sum(), perfect=False))
        return out

    def encode() -> list[np.ndarray]:
        out = []
        for (s, _), m in zip(split, models(), strict=True):
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(s, m)
            out.append(coder.get_compressed())
        return out

    theirs, their_enc, _ = best_of(encode, repeat)
    back, their_dec, _ = best_of(  # its models built in the timing, as `rans` reads its tables
        lambda: [
            constriction.stream.stack.AnsCoder(c).decode(m, s.size)
            for c, m, (s, _) in zip(theirs, models(), split, strict=True)
        ],
        repeat,
    )
    assert all(np.array_equal(b, s) for b, (s, _) in zip(back, split, strict=True))
    return {
        "streams": len(streams),
        "symbols": n,
        "entropy_bytes": entropy,
        "rans_bytes": sum(b.size for b in ours),
        "rans_encode_ns": 1e9 * ours_enc / n,
        "rans_decode_ns": 1e9 * ours_dec / n,
        "constriction_bytes": sum(c.nbytes for c in theirs) + escape_bytes,
        "constriction_encode_ns": 1e9 * their_enc / n,
        "constriction_decode_ns": 1e9 * their_dec / n,
    }


def markdown(res: dict) -> str:
    mb = res["entropy_bytes"] / 1e6
    rows = [
        f"{res['streams']} streams, {res['symbols']:,} integers; their empirical entropy (per "
        f"stream, escape bits included) {mb:.3f} MB",
        "",
        "| coder | MB | vs entropy | encode ns/integer | decode ns/integer |",
        "|---|---|---|---|---|",
    ]
    for key, label in (
        ("rans", "codec.rans (tables included)"),
        ("constriction", "constriction AnsCoder + Categorical (model not counted)"),
    ):
        b = res[f"{key}_bytes"]
        rows.append(
            f"| {label} | {b / 1e6:.3f} | {b / res['entropy_bytes']:.4f} | "
            f"{res[f'{key}_encode_ns']:.1f} | {res[f'{key}_decode_ns']:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="codec.rans against constriction on ctx streams")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--lr", type=learning_rate, default=3e-6)
    ap.add_argument("--step", type=count, default=6, help="the realistic step whose delta")
    ap.add_argument("--cache", type=folder, default=None)
    ap.add_argument("--repeat", type=count, default=2)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    streams = ctx_streams(args.model, args.lr, args.step, args.cache)
    res = {"model": args.model, "lr": args.lr, "step": args.step}
    res |= compare(streams, args.repeat)
    report(markdown(res), res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
