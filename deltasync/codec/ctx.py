"""The `ctx` delta encoding: positions and value steps coded per class of the base element.

Under Adam every element moves by about the learning rate, and a bf16 element changes only when
that crosses half its ulp, so an element's chance of changing, and how far its bit pattern
steps, are set mostly by its base exponent. Every reader holds the base, so the exponent is
free context: the elements of a tensor are split into *groups* of base exponents (cut points
chosen per tensor by the writer, each group with at least `MIN_GROUP` changes), and each group
codes its changed positions by their ranks among the group's own elements (as skips between
them) and its value steps under its own table. That costs about log2 C(n_g, k_g) per group
instead of log2 C(n, k) per tensor: about 0.7x of `ans` on RL deltas (BENCHMARKS.md).

Ranks are counted inside *tiles* (a fixed grid of the tensor as rows x columns, `tile_extent`)
so that a reader holding a box of the tensor (a tensor-parallel worker: a range of rows or of
columns on tile edges; a trainer rank: its rows) ranks only the elements it holds. The tables
and counts travel in the blob; the byte layout is bucket_layout.md, "Delta, `encoding=ctx`".
Each direction is one O(elements) compiled pass over the base (classification folded into the
rank count; the decoder's pass also applies the value steps) plus the rANS streams (`rans`).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec.ans import _codes as value_codes
from deltasync.codec.ans import raw_bits_for
from deltasync.codec.rans import _get_leb128, _put_leb128, decode_integers, encode_integers
from deltasync.codec.registry import TensorToDecode, register_codec
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.kernels.changes import WORKERS, TensorChange, bits
from deltasync.kernels.jit import compiled

__all__ = [
    "MIN_GROUP",
    "Grid",
    "decode_on_device",
    "decode_tensor",
    "encode_changes",
    "encode_tensor",
    "tile_extent",
]

MIN_GROUP = 512  # changes per exponent group at least (fewer: merged with the next exponents)
# Tile counts a blob may carry (groups x tiles) beyond one group's: what a reader allocates for
# them before it reads a change. A tensor whose sides are twice an odd number has tiles of one
# element, so tiles can reach its element count: its writer then merges groups to stay within.
MAX_TILE_COUNTS = 1 << 21
_SPLITS = 8  # tiles per dimension (the last one shorter, or empty, where padding falls)


def tile_extent(size: int) -> int:
    """Tile rows (or columns) along a dimension of `size`, such that every boundary of a 2-, 4-
    or 8-way tensor-parallel split falls on a tile edge: size * k / t for a linear layer (vLLM
    splits one only when t divides its size) and padded * k / t for a vocabulary (vLLM pads it
    to a multiple of 64, then splits it). An eighth of the padded size when the size is a
    multiple of 64 (every layer of a real model)."""
    padded = max(64, -(-size // 64) * 64) // _SPLITS
    if size % 2 or size == 0:
        return padded
    twos = min(3, (size & -size).bit_length() - 1)
    return math.gcd(padded, size >> twos)


@dataclass(frozen=True)
class Grid:
    """A tensor as rows x columns (dim 0 x the rest; a 1-D tensor is a column) and its tiles."""

    rows: int
    cols: int

    @classmethod
    def of(cls, shape: tuple[int, ...]) -> Grid:
        if not shape:
            return cls(1, 1)
        return cls(shape[0], int(np.prod(shape[1:], dtype=np.int64)))

    @property
    def tile_rows(self) -> int:
        return tile_extent(self.rows)

    @property
    def tile_cols(self) -> int:
        return tile_extent(self.cols)

    @property
    def tiles_across(self) -> int:
        return -(-self.cols // self.tile_cols)

    def tiles(self, r0: int, r1: int) -> int:
        """Tiles of rows `[r0, r1)` (a part's rows cut the tiles they meet)."""
        if r1 <= r0:
            return 0
        h = self.tile_rows
        return ((r1 - 1) // h - r0 // h + 1) * self.tiles_across


# --- the passes --------------------------------------------------------------------------------

_NONE = 1 << 62  # a skip count that never runs out: the (tile, group) has no change left


@compiled
def _skip_pass(
    base, base_r0, r0, r1, cols, h, w, lut, groups, idx, group, tile, skip
):  # pragma: no cover - compiled
    """Row-major, each changed flat index idx[p] (ascending, in rows [r0, r1)): its group,
    its tile (counted from row r0's tile row) and the number of its group's elements in the
    tile skipped since the group's previous change there (or the tile's start). `base` holds
    rows from `base_r0` on. Returns the count placed (every index inside the rows, once, when
    it equals idx.size)."""
    across = (cols + w - 1) // w
    n = idx.size
    since = np.zeros(across * groups, np.int64)
    first = r0 // h
    p = 0
    for r in range(r0, r1):
        if r == r0 or r % h == 0:
            since[:] = 0
        tile_row = (r // h - first) * across
        flat = r * cols
        wanted = idx[p] - flat if p < n else cols
        row_at = (r - base_r0) * cols
        for j in range(across):
            c0 = j * w
            c1 = min(cols, c0 + w)
            since_tile = since[j * groups : (j + 1) * groups]  # slices: fewer index sums
            segment = base[row_at + c0 : row_at + c1]
            wanted_c = wanted - c0
            for c in range(c1 - c0):
                k = lut[(np.uint16(segment[c]) >> 7) & 0xFF]
                if c == wanted_c:
                    group[p] = k
                    tile[p] = tile_row + j
                    skip[p] = since_tile[k]
                    since_tile[k] = 0
                    p += 1
                    wanted = idx[p] - flat if p < n else cols
                    wanted_c = wanted - c0
                else:
                    since_tile[k] += 1
    return p


@compiled
def _position_pass(
    base,
    base_r0,
    base_c0,
    width,
    r0,
    ra,
    rb,
    ca,
    cb,
    cols,
    h,
    w,
    lut,
    groups,
    start,
    skips,
    codes,
    out_index,
    out_previous,
    out_value,
):  # pragma: no cover - compiled
    """The inverse, row-major over the box rows [ra, rb) x columns [ca, cb) (on tile edges)
    of a stream of rows from r0: group g's changes in tile t are entries start[g, t] ..
    start[g, t + 1] of `skips` and `codes`; each becomes the base's flat index of its element
    (ascending), its base bits and its new bits (the base plus its value step: `codes` are
    zigzag steps less one, checked to fit 16 bits). Returns the count found, or -1 when a
    tile's group holds fewer elements than its skips lead past."""
    across = (cols + w - 1) // w
    ja, jb = ca // w, (cb + w - 1) // w
    left = np.zeros(across * groups, np.int64)
    cursor = np.zeros(across * groups, np.int64)
    end = np.zeros(across * groups, np.int64)
    first = r0 // h
    found = 0
    for r in range(ra, rb):
        tile_row = (r // h - first) * across
        if r == ra or r % h == 0:
            for j in range(ja, jb):
                for g in range(groups):
                    k = j * groups + g
                    e = start[g, tile_row + j]
                    cursor[k] = e
                    end[k] = start[g, tile_row + j + 1]
                    left[k] = skips[e] if e < end[k] else _NONE
        row_at = (r - base_r0) * width - base_c0
        for j in range(ja, jb):
            c0 = j * w
            c1 = min(cb, c0 + w)
            at = j * groups
            pending = left[at : at + groups]  # slices: fewer index sums
            segment = base[row_at + c0 : row_at + c1]
            for c in range(c1 - c0):
                old = segment[c]
                k = lut[(np.uint16(old) >> 7) & 0xFF]
                d = pending[k]
                if d == 0:
                    e = cursor[at + k]
                    code = codes[e] + 1
                    out_index[found] = row_at + c0 + c
                    out_previous[found] = old
                    out_value[found] = np.int16(np.int64(old) + ((code >> 1) ^ -(code & 1)))
                    found += 1
                    e += 1
                    cursor[at + k] = e
                    pending[k] = skips[e] if e < end[at + k] else _NONE
                else:
                    pending[k] = d - 1
        if r + 1 == rb or (r + 1) % h == 0:
            for k in range(ja * groups, jb * groups):
                if cursor[k] != end[k]:
                    return -1
    return found


@compiled
def _by_group(
    group, tile, skip, all_codes, tiles, counts, skips, codes, sums
):  # pragma: no cover - compiled
    """The pass's changes (row-major) into stream order: by group, then tile, then row-major
    inside a tile (a stable counting sort on group x tile), with each one's value code; the
    counts per (group, tile) and the sum of each group's skips."""
    for p in range(group.size):
        counts[group[p] * tiles + tile[p]] += 1
        sums[group[p]] += skip[p]
    at = np.zeros(counts.size, np.int64)
    for key in range(1, counts.size):
        at[key] = at[key - 1] + counts[key - 1]
    for p in range(group.size):
        key = group[p] * tiles + tile[p]
        q = at[key]
        at[key] = q + 1
        skips[q] = skip[p]
        codes[q] = all_codes[p]


# --- encoding ----------------------------------------------------------------------------------


def max_groups(count: int, tiles: int) -> int:
    """The most exponent groups a blob of `count` changes over `tiles` tiles may have: each
    group holds at least `MIN_GROUP` changes, and the tile counts stay within
    `MAX_TILE_COUNTS` (or one group's)."""
    return max(1, min(256, count // MIN_GROUP, MAX_TILE_COUNTS // max(1, tiles)))


def _cuts(exponents: np.ndarray, most: int = 256) -> np.ndarray:
    """Group boundaries (ascending exponents 1..255, a group starts at each) such that every
    group holds at least MIN_GROUP of the changed elements' base exponents, and there are at
    most `most` groups."""
    counts = np.bincount(exponents, minlength=256)
    least = max(MIN_GROUP, -(-exponents.size // most))
    cuts, acc = [], 0
    for e in range(256):
        if acc >= least and counts[e]:
            cuts.append(e)
            acc = 0
        acc += int(counts[e])
    if cuts and acc < least:
        cuts.pop()
    return np.asarray(cuts, np.int64)


def _lut(cuts: np.ndarray) -> np.ndarray:
    return np.searchsorted(cuts, np.arange(256), side="right").astype(np.int64)


def encode_tensor(
    change: TensorChange, base: torch.Tensor, shape: tuple[int, ...], rows: tuple[int, int]
) -> np.ndarray:
    """The `<name>.ctx` blob of one tensor's changes (global flat indices in rows `rows`),
    against `base`: the tensor's bf16 values of those rows."""
    grid = Grid.of(shape)
    base_bits = bits(base.contiguous())
    if base_bits.size != (rows[1] - rows[0]) * grid.cols:
        raise ValueError(f"base of {base_bits.size} elements for rows {rows} of {shape}")
    idx = np.ascontiguousarray(change.indices.numpy(), np.int64)
    previous = bits(change.previous).view(np.uint16)
    most = max_groups(idx.size, grid.tiles(*rows))
    cuts = _cuts(((previous >> 7) & 0xFF).astype(np.int64), most)
    groups = cuts.size + 1
    n = idx.size
    group = np.empty(n, np.int64)
    tile, skip = np.empty(n, np.int64), np.empty(n, np.int64)
    placed = _skip_pass(
        base_bits, rows[0], rows[0], rows[1], grid.cols, grid.tile_rows, grid.tile_cols,
        _lut(cuts), groups, idx, group, tile, skip,
    )  # fmt: skip
    if placed != n:
        raise ValueError("changed indices outside the rows, unsorted or repeated")
    tiles = grid.tiles(*rows)
    counts = np.zeros(groups * tiles, np.int64)
    skips, codes, sums = np.empty(n, np.int64), np.empty(n, np.int64), np.zeros(groups, np.int64)
    _by_group(group, tile, skip, value_codes(change), tiles, counts, skips, codes, sums)
    head = np.empty(20 + groups + 20 * groups, np.uint8)
    p = _put_leb128(head, 0, groups)
    head[p : p + cuts.size] = cuts
    p += cuts.size
    streams = [encode_integers(counts, 0)]
    bounds = np.concatenate(([0], np.cumsum(counts.reshape(groups, tiles).sum(axis=1))))
    for g in range(groups):
        lo, hi = bounds[g], bounds[g + 1]
        raw = raw_bits_for(sums[g] / (hi - lo)) if hi > lo else 0
        streams += [encode_integers(skips[lo:hi], raw), encode_integers(codes[lo:hi], 0)]
    for stream in streams:
        p = _put_leb128(head, p, stream.size)
    return np.concatenate([head[:p], *streams])


def encode_changes(
    changes: dict[str, TensorChange],
    base: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    rows: dict[str, tuple[int, int]] | None = None,
    *,
    workers: int = WORKERS,
) -> dict[str, torch.Tensor]:
    """The U8 payload tensors of a `ctx` delta: one `<name>.ctx` blob per changed tensor.
    `base` holds each tensor's values at the base version (its `rows` of them for a part)."""

    def one(name: str) -> torch.Tensor:
        span = rows[name] if rows is not None else (0, shapes[name][0] if shapes[name] else 1)
        return torch.from_numpy(encode_tensor(changes[name], base[name], shapes[name], span))

    # the most changed tensors first, so that no thread is left with a large one at the end
    order = sorted(changes, key=lambda n: -changes[n].indices.numel())
    with ThreadPoolExecutor(workers) as pool:
        blobs = dict(zip(order, pool.map(one, order), strict=True))
    return {f"{n}.ctx": blobs[n] for n in changes}


# --- decoding ----------------------------------------------------------------------------------


def _leb(data: np.ndarray, p: int, what: str) -> tuple[int, int]:
    value, p = _get_leb128(data, p)
    if p < 0:
        raise FormatError(f"{what}: the blob's header ends early")
    return int(value), p


def _header(data: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(group cuts, the streams: counts, then each group's gaps and vals)."""
    groups, p = _leb(data, 0, "ctx")
    if not 1 <= groups <= 256:
        raise FormatError(f"ctx: {groups} exponent groups (1..256)")
    if p + groups - 1 > data.size:
        raise FormatError("ctx: the blob's header ends early")
    cuts = data[p : p + groups - 1].astype(np.int64)
    p += groups - 1
    if cuts.size and (cuts[0] < 1 or np.any(np.diff(cuts) <= 0)):
        raise FormatError("ctx: group cuts must ascend strictly from 1")
    sizes = []
    for _ in range(1 + 2 * groups):
        size, p = _leb(data, p, "ctx")
        sizes.append(size)
    if p + sum(sizes) != data.size:
        raise FormatError(f"ctx: streams of {sum(sizes)} bytes in {data.size - p} bytes")
    streams = []
    for size in sizes:
        streams.append(data[p : p + size])
        p += size
    return cuts, streams


def _region(grid: Grid, rows: tuple[int, int], box: Box | None) -> tuple[int, int, int, int]:
    """The rows and columns of the stream a reader decodes: its box's, which must lie on tile
    edges (or the stream's own edges)."""
    ra, rb = rows
    ca, cb = 0, grid.cols
    if box is None:
        return ra, rb, ca, cb
    ra, rb = max(ra, box.rows[0]), min(rb, box.rows[1])
    if box.cols is not None:
        ca, cb = box.cols
    h, w = grid.tile_rows, grid.tile_cols
    edges_ok = (ra % h == 0 or ra == rows[0]) and (rb % h == 0 or rb == rows[1] or rb <= ra)
    edges_ok = edges_ok and ca % w == 0 and (cb % w == 0 or cb == grid.cols)
    if not edges_ok:
        raise FormatError(
            f"the reader's box rows {box.rows} cols {box.cols} cut the encoding's tiles "
            f"({h} x {w}); publish this run with another encoding (ans)"
        )
    return ra, max(ra, rb), ca, cb


def _streams(
    blob: torch.Tensor, count: int, grid: Grid, rows: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(cuts, start, skips, codes): group g's changes in tile t are entries start[g, t] ..
    start[g, t + 1] of `skips` and `codes` (counts validated, every code checked to fit 16 bits
    here; skips checked by the pass)."""
    data = np.ascontiguousarray(blob.numpy())
    cuts, streams = _header(data)
    groups = cuts.size + 1
    tiles = grid.tiles(*rows)
    if groups > max_groups(count, tiles):  # before a count is allocated
        raise FormatError(
            f"ctx: {groups} exponent groups for {count} changes in {tiles} tiles; at most "
            f"{max_groups(count, tiles)} (each group holds {MIN_GROUP} changes or more)"
        )
    counts = decode_integers(streams[0], groups * tiles, "ctx counts").reshape(groups, tiles)
    if counts.sum() != count or (counts > grid.tile_rows * grid.tile_cols).any():
        raise FormatError(f"ctx: the tiles' counts do not add up to {count} changes")
    if groups > 1 and (counts.sum(axis=1) < MIN_GROUP).any():
        raise FormatError(f"ctx: a group of fewer than {MIN_GROUP} changes")
    start = np.zeros((groups, tiles + 1), np.int64)
    start[:, 1:] = np.cumsum(counts, axis=1)
    start += np.concatenate(([0], np.cumsum(counts.sum(axis=1))[:-1]))[:, None]
    skips, codes = np.empty(count, np.int64), np.empty(count, np.int64)
    for g in range(groups):
        lo, k = start[g, 0], start[g, -1] - start[g, 0]
        skips[lo : lo + k] = decode_integers(streams[1 + 2 * g], k, f"ctx group {g} gaps")
        codes[lo : lo + k] = decode_integers(streams[2 + 2 * g], k, f"ctx group {g} vals")
    if count and codes.max() >= (1 << 16) - 1:  # a step past 16 bits
        raise FormatError("a value step is out of range")
    return cuts, start, skips, codes


def _origin(grid: Grid, offset: int, box: Box | None) -> tuple[int, int, int]:
    """(first row, first column, row width) of the base the reader holds."""
    if box is not None:
        return box.rows[0], box.cols[0] if box.cols else 0, box.width
    return offset // grid.cols if grid.cols else 0, 0, grid.cols


def decode_tensor(
    blob: torch.Tensor,
    count: int,
    base: torch.Tensor,
    shape: tuple[int, ...],
    *,
    rows: tuple[int, int] | None = None,
    offset: int = 0,
    box: Box | None = None,
) -> TensorChange:
    """Decode one tensor's changes against the base the reader holds (validated, nothing
    mutated): the whole tensor, its rows from flat `offset` on (a trainer rank), or a
    tensor-parallel worker's `box`. `rows`: the rows the blob covers (a part's; default all).
    Indices come back as the base's own flat indices."""
    grid = Grid.of(shape)
    rows = rows or (0, grid.rows)
    cuts, start, skips, codes = _streams(blob, count, grid, rows)
    groups = cuts.size + 1
    ra, rb, ca, cb = _region(grid, rows, box)
    base_r0, base_c0, width = _origin(grid, offset, box)
    base_bits = bits(base.detach().contiguous())
    if rb > ra and (ra < base_r0 or (rb - base_r0) * width > base_bits.size):
        raise FormatError(f"ctx: rows {ra}:{rb} lie outside the base the reader holds")
    held = min(count, (rb - ra) * (cb - ca))
    out_index = np.empty(held, np.int64)
    previous, values = np.empty(held, np.int16), np.empty(held, np.int16)
    found = _position_pass(
        base_bits,
        base_r0,
        base_c0,
        width,
        rows[0],
        ra,
        rb,
        ca,
        cb,
        grid.cols,
        grid.tile_rows,
        grid.tile_cols,
        _lut(cuts),
        groups,
        start,
        skips,
        codes,
        out_index,
        previous,
        values,
    )
    if found < 0:
        raise FormatError("ctx: a skip leads past its group's elements in its tile")
    if box is None and found != count:
        raise FormatError(f"ctx: {found} changes found, metadata says {count}")
    return TensorChange(
        torch.from_numpy(out_index[:found]),
        torch.from_numpy(values[:found]).view(torch.bfloat16),
        torch.from_numpy(previous[:found]).view(torch.bfloat16),
    )


def decode_on_device(
    blob: torch.Tensor,
    count: int,
    held: torch.Tensor,
    shape: tuple[int, ...],
    *,
    staged: list[TensorChange] | None = None,
    rows: tuple[int, int] | None = None,
    box: Box | None = None,
    chunk: int = 1 << 22,
) -> TensorChange:
    """`decode_tensor` for a base that stays where it lives (a device sink's parameter, box or
    whole): the classes and ranks are computed there, by torch, `chunk` elements at a time,
    and only the changes' indices cross to the host. `staged`: changes of earlier deltas not
    yet written into `held` (they move classes). The values come back as steps against zeros
    (bits new - base), as `codec.files` rebases a gathering base's changes. Transient memory
    where `held` lives: about 20 bytes per element of a chunk (4M elements by default)."""
    grid = Grid.of(shape)
    rows = rows or (0, grid.rows)
    cuts, start, skips, codes = _streams(blob, count, grid, rows)
    ra, rb, ca, cb = _region(grid, rows, box)
    base_r0, base_c0, width = _origin(grid, 0, box)
    device, h, w = held.device, grid.tile_rows, grid.tile_cols
    groups, across = cuts.size + 1, grid.tiles_across
    ja, jb = ca // w, -(-cb // w)
    lut = torch.from_numpy(_lut(cuts).astype(np.uint8)).to(device)
    plane = held.detach()
    if plane.dim() != 2 or plane.shape[1] != width:
        plane = plane.reshape(-1, width)
    plane = plane.view(torch.int16)
    # each entry's rank among its group's elements in its tile, counted from 1
    ranks = np.cumsum(skips + 1)
    firsts = start[:, :-1].reshape(-1)
    sizes = np.diff(start, axis=1).reshape(-1)
    ranks -= np.repeat(np.concatenate(([0], ranks))[firsts], sizes)
    found_index, found_entry = [], []
    rows_per = max(1, chunk // max(1, cb - ca))
    origin = (base_r0, base_c0, width)
    overlays = _staged_classes(staged or [], lut, origin, (ca, cb), device)
    for tile_row in range(ra // h, -(-rb // h) if rb > ra else ra // h):
        r_lo, r_hi = max(ra, tile_row * h), min(rb, (tile_row + 1) * h)
        first = (tile_row - rows[0] // h) * across
        carry = torch.zeros((jb - ja, groups), dtype=torch.int64, device=device)
        wanted = _wanted(start, ranks, first + ja, first + jb, device)
        for r in range(r_lo, r_hi, rows_per):
            r_end = min(r_hi, r + rows_per)
            part = plane[r - base_r0 : r_end - base_r0, ca - base_c0 : cb - base_c0]
            classes = lut[((part.to(torch.int32) >> 7) & 0xFF).long()]
            for row, col, value in overlays:  # in staging order: a later delta's value wins
                inside = (row >= r) & (row < r_end)
                classes[row[inside] - r, col[inside]] = value[inside]
            index, entry = _find(classes, wanted, carry, r, ca, origin, w, groups)
            found_index.append(index)
            found_entry.append(entry)
        for g, (tiles, want, _) in wanted.items():
            if bool((want > carry[tiles, g]).any()):
                raise FormatError("ctx: a skip leads past its group's elements in its tile")
    index = torch.cat(found_index) if found_index else torch.zeros(0, dtype=torch.int64)
    entry = torch.cat(found_entry) if found_entry else torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(index)
    index, entry = index[order].cpu().numpy(), entry[order].cpu().numpy()
    if box is None and index.size != count:
        raise FormatError(f"ctx: {index.size} changes found, metadata says {count}")
    steps = codes[entry] + 1
    steps = ((steps >> 1) ^ -(steps & 1)).astype(np.int16)
    return TensorChange(
        torch.from_numpy(index),
        torch.from_numpy(steps).view(torch.bfloat16),
        torch.zeros(index.size, dtype=torch.bfloat16),
    )


def _wanted(start, ranks, t_lo, t_hi, device) -> dict:
    """Per group with changes in tiles [t_lo, t_hi): (the tiles' offsets from t_lo, the ranks
    wanted there, their entries) on `device`."""
    out = {}
    for g in range(start.shape[0]):
        lo, hi = start[g, t_lo], start[g, t_hi]
        if hi == lo:
            continue
        tiles = np.repeat(np.arange(t_hi - t_lo), np.diff(start[g, t_lo : t_hi + 1]))
        out[g] = tuple(
            torch.from_numpy(a).to(device) for a in (tiles, ranks[lo:hi], np.arange(lo, hi))
        )
    return out


def _staged_classes(staged, lut, origin, cols, device) -> list:
    """Per earlier staged delta, in staging order: (row, column from `cols[0]`, class) on
    `device` of each element in columns `cols` it changed, from its new value."""
    base_r0, base_c0, width = origin
    found = []
    for change in staged:
        row = change.indices // width + base_r0
        col = change.indices % width + base_c0
        inside = (col >= cols[0]) & (col < cols[1])
        new = change.values[inside].view(torch.int16).to(torch.int32).to(device)
        value = lut[((new >> 7) & 0xFF).long()]
        found.append((row[inside].to(device), (col[inside] - cols[0]).to(device), value))
    return found


def _find(classes, wanted, carry, first_row, first_col, origin, w, groups):
    """The (base index, entry) of every wanted rank among these rows of a tile row (columns
    from `first_col`, a tile edge), moving `carry` (each tile's count of each group so far)."""
    base_r0, base_c0, width = origin
    n_rows, n_cols = classes.shape
    tiles = carry.shape[0]
    if tiles * w > n_cols:  # the last tile is narrower: pad it with a class of no group
        classes = torch.nn.functional.pad(classes, (0, tiles * w - n_cols), value=groups)
    by_tile = classes.reshape(n_rows, tiles, w).permute(1, 0, 2).reshape(tiles, n_rows * w)
    length = n_rows * w
    apart = torch.arange(tiles, device=classes.device)[:, None] << 40  # one ascending sequence
    index, entries = [], []
    for g, (tile, want, entry) in wanted.items():
        counted = (by_tile == g).cumsum(1) + carry[:, g : g + 1]
        here = (want > carry[tile, g]) & (want <= counted[tile, -1])
        if bool(here.any()):
            at = torch.searchsorted((counted + apart).reshape(-1), want[here] + (tile[here] << 40))
            t, within = at // length, at % length
            row = within // w + first_row
            col = t * w + within % w + first_col
            index.append((row - base_r0) * width + (col - base_c0))
            entries.append(entry[here])
        carry[:, g] = counted[:, -1]
    if not index:
        empty = torch.zeros(0, dtype=torch.int64, device=classes.device)
        return empty, empty
    return torch.cat(index), torch.cat(entries)


def _decode(one: TensorToDecode) -> TensorChange:
    (blob,) = one.arrays
    if one.held is not None:  # classes and ranks where the base lives
        held, staged = one.held.held(one.name)
        return decode_on_device(
            blob, one.changed, held, one.shape, staged=staged, rows=one.rows, box=one.box
        )
    return decode_tensor(
        blob, one.changed, one.target, one.shape, rows=one.rows, offset=one.offset, box=one.box
    )


register_codec(
    "ctx",
    encode=lambda changes, shapes, base, rows: encode_changes(changes, base, shapes, rows),
    decode=_decode,
    needs_base=True,
    device_decode=True,
)
