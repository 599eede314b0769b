"""The `ctx` encoding: positions and value steps coded per exponent group of the base element,
ranked inside a grid of tiles so that a reader holding a box (a tensor-parallel worker's rows or
columns, a trainer rank's rows) decodes only what it holds; hostile blobs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.codec import ans, ctx, decode, encode_delta
from deltasync.codec.rans import _put_leb128, decode_integers, encode_integers
from deltasync.errors import FormatError
from deltasync.kernels.boxes import Box
from deltasync.kernels.changes import TensorChange
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.snapshot import Bf16Snapshot


def _adam_like(shape: tuple[int, ...], seed: int = 0, lr: float = 3e-6):
    """(base, new, change): fp32 master weights over several octaves, each moved by about `lr`
    (as Adam moves them), both seen in bf16: small elements change far more often."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(shape, generator=gen) * 0.02 * torch.exp(torch.randn(shape, generator=gen))
    step = torch.randn(shape, generator=gen).sign() * lr
    base, new = master.bfloat16(), (master + step).bfloat16()
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    idx = torch.nonzero(flat_base.view(torch.int16) != flat_new.view(torch.int16)).reshape(-1)
    return base, new, TensorChange(idx, flat_new[idx], flat_base[idx])


def _encode(change, base, shape, rows=None):
    rows = rows or (0, shape[0] if shape else 1)
    return torch.from_numpy(ctx.encode_tensor(change, base, shape, rows))


def _same(got: TensorChange, indices: np.ndarray, values: torch.Tensor) -> None:
    assert np.array_equal(got.indices.numpy(), indices)
    assert np.array_equal(got.values.view(torch.int16).numpy(), values.view(torch.int16).numpy())


@pytest.mark.parametrize("shape", [(512, 256), (320, 64), (4096,), (), (16, 8, 24)])
def test_round_trip_against_the_whole_base(shape):
    base, _, change = _adam_like(shape, lr=1e-3)
    assert change.indices.numel()
    blob = _encode(change, base, shape)
    got = ctx.decode_tensor(blob, change.indices.numel(), base, shape)
    _same(got, change.indices.numpy(), change.values)
    assert torch.equal(got.previous.view(torch.int16), change.previous.view(torch.int16))


def test_a_third_smaller_than_ans_where_the_exponent_predicts_the_change():
    base, _, change = _adam_like((1024, 1024))
    ctx_bytes = _encode(change, base, (1024, 1024)).numel()
    ans_bytes = sum(t.numel() for t in ans.encode_changes({"w": change}).values())
    assert ctx_bytes < 0.8 * ans_bytes, (ctx_bytes, ans_bytes)


def _boxes(shape: tuple[int, int], workers: int, padded: int | None = None) -> list[Box]:
    """The boxes of a 2-D tensor split over `workers` as vLLM splits it: rows of a column-
    parallel linear or of a vocabulary padded to `padded` rows, columns of a row-parallel one."""
    rows, cols = shape
    size = (padded or rows) // workers
    by_rows = [Box(shape, (min(rows, k * size), min(rows, (k + 1) * size))) for k in range(workers)]
    step = cols // workers
    by_cols = [Box(shape, (0, rows), (k * step, (k + 1) * step)) for k in range(workers)]
    return by_rows + by_cols


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize(("shape", "padded"), [((1024, 512), None), ((300, 128), 320)])
def test_each_tensor_parallel_box_decodes_only_what_it_holds(shape, padded, workers):
    base, _, change = _adam_like(shape, seed=workers)
    blob = _encode(change, base, shape)
    count = change.indices.numel()
    for box in _boxes(shape, workers, padded):
        got = ctx.decode_tensor(blob, count, box.take(base), shape, box=box)
        local, kept = box.localize(change.indices.numpy())
        _same(
            got,
            local,
            change.values[torch.as_tensor(kept)]
            if not isinstance(kept, slice)
            else change.values[kept],
        )


def test_a_box_that_cuts_the_tiles_is_refused_naming_it():
    shape = (1024, 512)
    base, _, change = _adam_like(shape)
    box = Box(shape, (0, 100))
    with pytest.raises(FormatError, match=r"box rows \(0, 100\).*cut the encoding's tiles"):
        ctx.decode_tensor(
            _encode(change, base, shape), change.indices.numel(), box.take(base), shape, box=box
        )


def test_a_part_of_rows_decodes_against_the_whole_base_and_against_its_own_rows():
    shape, (r0, r1) = (1000, 96), (334, 667)  # FSDP2's rows of three ranks: no tile edge
    base, _, change = _adam_like(shape)
    lo, hi = r0 * 96, r1 * 96
    inside = (change.indices >= lo) & (change.indices < hi)
    part = TensorChange(change.indices[inside], change.values[inside], change.previous[inside])
    blob = _encode(part, base[r0:r1], shape, (r0, r1))
    count = part.indices.numel()
    whole = ctx.decode_tensor(blob, count, base, shape, rows=(r0, r1))
    _same(whole, part.indices.numpy(), part.values)
    own = ctx.decode_tensor(blob, count, base[r0:r1], shape, rows=(r0, r1), offset=lo)
    _same(own, part.indices.numpy() - lo, part.values)


def test_a_part_outside_the_rows_the_reader_holds_is_refused():
    shape, (r0, r1) = (1000, 96), (334, 667)
    base, _, change = _adam_like(shape)
    inside = (change.indices >= r0 * 96) & (change.indices < r1 * 96)
    part = TensorChange(change.indices[inside], change.values[inside], change.previous[inside])
    blob = _encode(part, base[r0:r1], shape, (r0, r1))
    with pytest.raises(FormatError, match="outside the base"):  # the reader holds rows 0:333
        ctx.decode_tensor(blob, part.indices.numel(), base[:333], shape, rows=(r0, r1))


def test_encoding_needs_the_base():
    base, new = {"w": torch.ones(4, 4).bfloat16()}, {"w": torch.full((4, 4), 2.0).bfloat16()}
    diff = Bf16Snapshot({k: v.clone() for k, v in base.items()}).diff(new)
    with pytest.raises(ValueError, match="pass `base`"):
        encode_delta(
            diff, run_id="r", version=2, base_version=1, state_digest=full_state_digest(new),
            encoding="ctx",
        )  # fmt: skip


# --- hostile blobs -------------------------------------------------------------------------


SHAPE = (256, 128)
BASE, _, CHANGE = _adam_like(SHAPE, lr=2e-5)
COUNT = CHANGE.indices.numel()
BLOB = _encode(CHANGE, BASE, SHAPE).numpy()


def _parse(blob: np.ndarray) -> tuple[int, list[int], list[np.ndarray]]:
    """(groups, cuts, streams) as bucket_layout.md lays them out."""
    groups, p = int(blob[0]), 1  # fewer than 128 groups: one LEB128 byte
    cuts = [int(c) for c in blob[p : p + groups - 1]]
    p += groups - 1
    sizes = []
    for _ in range(1 + 2 * groups):
        value, shift = 0, 0
        while True:
            byte = int(blob[p])
            p += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        sizes.append(value)
    streams = []
    for size in sizes:
        streams.append(blob[p : p + size])
        p += size
    assert p == blob.size
    return int(groups), cuts, streams


def _join(groups: int, cuts: list[int], streams: list[np.ndarray]) -> torch.Tensor:
    head = np.empty(16 + len(cuts) + 10 * len(streams), np.uint8)
    p = _put_leb128(head, 0, groups)
    head[p : p + len(cuts)] = cuts
    p += len(cuts)
    for stream in streams:
        p = _put_leb128(head, p, stream.size)
    return torch.from_numpy(np.concatenate([head[:p], *streams]))


def test_the_parser_of_these_tests_reads_the_writers_blob():
    groups, cuts, streams = _parse(BLOB)
    assert groups > 2 and len(streams) == 1 + 2 * groups
    got = ctx.decode_tensor(_join(groups, cuts, streams), COUNT, BASE, SHAPE)
    _same(got, CHANGE.indices.numpy(), CHANGE.values)


def _counts(streams, tiles):
    return decode_integers(streams[0], (len(streams) - 1) // 2 * tiles, "counts")


def _hostile():
    groups, cuts, streams = _parse(BLOB)
    tiles = ctx.Grid.of(SHAPE).tiles(0, SHAPE[0])
    counts = _counts(streams, tiles)
    far = [s.copy() for s in streams]
    far[1] = encode_integers(np.full(int(counts[:tiles].sum()), 10**6), 0)
    yield "no groups", _join(0, [], streams[:1])
    yield "cuts that descend", _join(groups, cuts[::-1], streams)
    yield "a cut at exponent 0", _join(groups, [0, *cuts[1:]], streams)
    yield "a stream cut short", _join(groups, cuts, [*streams[:-1], streams[-1][:-3]])
    yield "trailing bytes", torch.cat([torch.from_numpy(BLOB), torch.zeros(3, dtype=torch.uint8)])
    yield (
        "counts that miss a change",
        _join(
            groups, cuts, [encode_integers(np.maximum(counts - (counts > 0), 0), 0), *streams[1:]]
        ),
    )
    yield "skips past the group's elements", _join(groups, cuts, far)
    yield "a group merged away", _join(groups - 1, cuts[:-1], streams[:-2])
    big = [s.copy() for s in streams]  # a value code past 16 bits: a step no bf16 makes
    vals = decode_integers(streams[2], int(counts[:tiles].sum()), "vals")
    big[2] = encode_integers(np.concatenate([vals[:-1], [(1 << 16) - 1]]), 0)
    yield "a value code past 16 bits", _join(groups, cuts, big)


@pytest.mark.parametrize(("what", "blob"), list(_hostile()), ids=[w for w, _ in _hostile()])
def test_hostile_blobs_are_refused_and_change_nothing(what, blob):
    """Refused by the host decoder and by the device one (torch, here on CPU tensors)."""
    before = BASE.clone()
    with pytest.raises(FormatError):
        ctx.decode_tensor(blob, COUNT, BASE, SHAPE)
    with pytest.raises(FormatError):
        ctx.decode_on_device(blob, COUNT, BASE, SHAPE, chunk=1 << 12)
    assert torch.equal(BASE.view(torch.int16), before.view(torch.int16)), what


def test_a_whole_file_decodes_through_the_codec():
    base = {"w": BASE, "b": _adam_like((64,), seed=3)[0]}
    new = {"w": _adam_like(SHAPE, lr=2e-5)[1], "b": _adam_like((64,), seed=3)[1]}
    diff = Bf16Snapshot({k: v.clone() for k, v in base.items()}).diff(new)
    blob = encode_delta(
        diff, run_id="r", version=2, base_version=1, state_digest=full_state_digest(new),
        encoding="ctx", base=base,
    )  # fmt: skip
    decoded = decode(blob, base=base)
    assert decoded.meta.encoding == "ctx"
    for name, change in diff.changes.items():
        _same(decoded.changes[name], change.indices.numpy(), change.values)
