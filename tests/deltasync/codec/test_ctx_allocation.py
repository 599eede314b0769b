"""A `ctx` blob of a few KB cannot make a reader allocate more than an honest blob does.

A tensor whose sides are twice an odd number has tiles of one element, so a blob declaring many
exponent groups asks for groups x elements tile counts; the decoders (host and device) refuse
it by its group count, before anything is allocated. Peaks are measured in a fresh process
(`resource`'s peak RSS) against an honest blob's on the same tensor.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from deltasync.codec import ctx
from deltasync.codec.rans import _put_leb128, encode_integers
from deltasync.kernels.changes import TensorChange

SHAPE = (510, 514)  # 2 x 255 by 2 x 257: one tile per element
COUNT = 600  # changes an honest blob carries: one exponent group
MIB = 1 << 20

MEASURE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np, torch
    from deltasync.codec import ctx
    from deltasync.errors import FormatError

    base = torch.from_numpy(np.load(sys.argv[1])).view(torch.bfloat16)
    blob = torch.from_numpy(np.fromfile(sys.argv[2], np.uint8))
    count, device = int(sys.argv[3]), sys.argv[4] == "device"
    shape = tuple(base.shape)
    decode = ctx.decode_on_device if device else ctx.decode_tensor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        decode(blob, count, base, shape)
        outcome = "decoded"
    except FormatError as exc:
        outcome = f"refused: {exc}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - before) * 1024)
    print(outcome)
    """
)


def _hostile_blob(groups: int) -> np.ndarray:
    """`groups` exponent groups whose tile counts are all zero (they rANS-code to a few
    bytes), then empty gap and value streams: valid framing, nothing honest about the groups."""
    tiles = ctx.Grid.of(SHAPE).tiles(0, SHAPE[0])
    streams = [encode_integers(np.zeros(groups * tiles, np.int64), 0)]
    streams += [encode_integers(np.zeros(0, np.int64), 0)] * (2 * groups)
    head = np.empty(20 + groups + 20 * (2 * groups + 1), np.uint8)
    p = _put_leb128(head, 0, groups)
    head[p : p + groups - 1] = np.arange(1, groups)
    p += groups - 1
    for stream in streams:
        p = _put_leb128(head, p, stream.size)
    return np.concatenate([head[:p], *streams])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ctx")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    indices = torch.randperm(base.numel(), generator=gen)[:COUNT].sort().values
    values = (base.view(-1)[indices].float() * 1.01).to(torch.bfloat16)
    change = TensorChange(indices, values, base.view(-1)[indices])
    honest = ctx.encode_tensor(change, base, SHAPE, (0, SHAPE[0]))
    np.save(folder / "base.npy", base.view(torch.int16).numpy())
    honest.tofile(folder / "honest.bin")
    hostile = _hostile_blob(256)
    hostile.tofile(folder / "hostile.bin")
    assert hostile.size < 8192  # a few KB
    return folder


def _peak(folder, blob: str, device: bool) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder / "base.npy"), str(folder / blob), str(COUNT),
         "device" if device else "host"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    peak, outcome = done.stdout.splitlines()[:2]
    return int(peak), outcome


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_a_hostile_ctx_blob_is_refused_within_an_honest_blobs_memory(files, device):
    honest_peak, honest = _peak(files, "honest.bin", device)
    hostile_peak, hostile = _peak(files, "hostile.bin", device)
    assert honest == "decoded"
    assert hostile_peak <= honest_peak + 64 * MIB, (hostile_peak / MIB, honest_peak / MIB)
    assert hostile.startswith("refused: ctx: 256 exponent groups for 600 changes"), hostile


def test_a_writer_merges_groups_to_stay_within_the_tile_counts():
    """A dense change on a tensor of one-element tiles: the writer's groups fit what every
    reader accepts, and the blob round-trips."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(SHAPE, generator=gen).to(torch.bfloat16) * 2.0 ** torch.randint(
        -30, 30, SHAPE, generator=gen
    )
    base = base.to(torch.bfloat16)
    indices = torch.arange(0, base.numel(), 3)
    values = (base.view(-1)[indices].float() * 1.01).to(torch.bfloat16)
    change = TensorChange(indices, values, base.view(-1)[indices])
    blob = torch.from_numpy(ctx.encode_tensor(change, base, SHAPE, (0, SHAPE[0])))
    tiles = ctx.Grid.of(SHAPE).tiles(0, SHAPE[0])
    assert blob[0].item() <= ctx.MAX_TILE_COUNTS // tiles  # groups, in one LEB128 byte
    decoded = ctx.decode_tensor(blob, indices.numel(), base, SHAPE)
    assert torch.equal(decoded.indices, indices)
    assert torch.equal(decoded.values.view(torch.int16), values.view(torch.int16))
