"""Prototype alternatives to the `packed` streams, measured on realistic cached deltas.

Sizes (bits per changed element, payload only) and numpy encode time of:
- idx `leb128+zstd{1,3}`: what `packed` does (LEB128 gaps under zstd);
- idx `rice`: Golomb-Rice gaps with the best parameter per tensor (remainders as packed k-bit
  fields, quotients as a unary bit vector), no zstd;
- val `leb128+zstd{1,3}`: what `packed` does (zigzag bit-pattern difference, LEB128, zstd);
- val `signmag`: sign bits raw (packbits), a "|d| > 1" bit plane under zstd, and LEB128(|d| - 2)
  of the rest under zstd; `signmag(rice)`: the same with the "|d| > 1" positions Rice-coded.
All round-trip checked. Usage:
  .venv/bin/python -m bench.alt_codecs --model qwen3-100m --steps 8 \
      --cache /tmp/deltasync-bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import zstandard

from deltasync.arguments import count, folder, json_path, learning_rate

from .codec import _leb128, entropy_floor
from .models.qwen3 import SHAPES
from .output import save_json
from .realistic import deltas


def rice_encode(gaps: np.ndarray) -> tuple[int, bytes, bytes]:
    g = gaps.astype(np.uint64)
    n = g.size
    best_k = min(range(0, 24), key=lambda k: n * (k + 1) + int((g >> np.uint64(k)).sum()))
    q = (g >> np.uint64(best_k)).astype(np.int64)
    r = g & np.uint64((1 << best_k) - 1)
    if best_k:
        shifts = np.arange(best_k - 1, -1, -1, dtype=np.uint64)
        bits = ((r[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        low = np.packbits(bits.reshape(-1)).tobytes()
    else:
        low = b""
    unary = np.zeros(int(q.sum()) + n, np.uint8)
    unary[np.cumsum(q + 1) - 1] = 1
    return best_k, low, np.packbits(unary).tobytes()


def rice_decode(k: int, low: bytes, high: bytes, n: int) -> np.ndarray:
    ends = np.flatnonzero(np.unpackbits(np.frombuffer(high, np.uint8)))[:n]
    q = np.diff(ends, prepend=-1) - 1
    if k:
        bits = np.unpackbits(np.frombuffer(low, np.uint8))[: n * k].reshape(n, k)
        r = (bits.astype(np.uint64) << np.arange(k - 1, -1, -1, dtype=np.uint64)).sum(1)
    else:
        r = np.zeros(n, np.uint64)
    return (q.astype(np.uint64) << np.uint64(k)) | r


def signmag(d: np.ndarray, cz) -> int:
    """d: int32 differences (never 0). Bytes of sign plane + big plane (zstd) + rest (zstd)."""
    sign = np.packbits(d < 0)
    mag = np.abs(d)
    big = mag > 1
    rest = (mag[big] - 2).astype(np.uint64)
    return (
        len(sign.tobytes())
        + len(cz.compress(np.packbits(big).tobytes()))
        + len(cz.compress(_leb128(rest)))
    )


def signmag_rice(d: np.ndarray, cz) -> int:
    """As `signmag`, with the positions of |d| > 1 as Rice-coded gaps instead of a zstd plane."""
    mag = np.abs(d)
    big = np.flatnonzero(mag > 1)
    _, low, high = rice_encode(np.diff(big, prepend=-1) - 1)
    rest = (mag[big] - 2).astype(np.uint64)
    return (
        len(np.packbits(d < 0).tobytes())
        + len(low)
        + len(high)
        + 1
        + len(cz.compress(_leb128(rest)))
    )


def evaluate(diff, levels=(1, 3)) -> dict:
    k = diff.changed_elements
    out: dict[str, float] = {}
    times: dict[str, float] = {}
    czs = {lv: zstandard.ZstdCompressor(level=lv) for lv in levels}

    def add(key, nbytes, dt):
        out[key] = out.get(key, 0) + nbytes
        times[key] = times.get(key, 0) + dt

    for change in diff.changes.values():
        idx = change.indices.numpy()
        gaps = np.diff(idx, prepend=-1) - 1
        d = change.values.view(torch.int16).numpy().astype(np.int32) - change.previous.view(
            torch.int16
        ).numpy().astype(np.int32)
        d = (d + 32768) % 65536 - 32768
        zz = ((d << 1) ^ (d >> 31)).astype(np.uint32)
        for lv, cz in czs.items():
            t = time.perf_counter()
            add(f"idx leb128+zstd{lv}", len(cz.compress(_leb128(gaps))), time.perf_counter() - t)
            t = time.perf_counter()
            add(f"val leb128+zstd{lv}", len(cz.compress(_leb128(zz))), time.perf_counter() - t)
        t = time.perf_counter()
        rk, low, high = rice_encode(gaps)
        add("idx rice", len(low) + len(high) + 1, time.perf_counter() - t)
        assert np.array_equal(rice_decode(rk, low, high, gaps.size), gaps.astype(np.uint64))
        t = time.perf_counter()
        add("val signmag(zstd1)", signmag(d, czs[levels[0]]), time.perf_counter() - t)
        t = time.perf_counter()
        add("val signmag(rice)", signmag_rice(d, czs[levels[0]]), time.perf_counter() - t)
    ent = entropy_floor(diff)
    res = {"density": diff.density, "idx_floor": ent["idx_floor"], "val_floor": ent["val_floor"]}
    res.update({f"{key} bits": 8 * b / k for key, b in out.items()})
    res.update({f"{key} s": s for key, s in times.items()})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="alternative index/value streams")
    ap.add_argument("--model", default="qwen3-100m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=count, default=6)
    ap.add_argument("--lr", type=learning_rate, default=1e-6)
    ap.add_argument("--cache", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for step, diff in enumerate(
        deltas(
            args.model,
            args.steps,
            lr=args.lr,
            cache=args.cache,
            log=lambda m: print(m, file=sys.stderr),
        ),
        1,
    ):
        r = {"step": step, **evaluate(diff)}
        rows.append(r)
        print(
            json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
            flush=True,
        )
    keys = [k for k in rows[0] if k.endswith(" bits")]
    print("| step | density | idx floor | " + " | ".join(keys) + " | val floor |")
    print("|---" * (len(keys) + 4) + "|")
    for r in rows:
        print(
            f"| {r['step']} | {100 * r['density']:.2f} % | {r['idx_floor']:.2f} | "
            + " | ".join(f"{r[k]:.2f}" for k in keys)
            + f" | {r['val_floor']:.2f} |"
        )
    save_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
