"""The one fp32 -> bf16 rule both change detections follow, pinned as bit patterns.

CI has no GPU: the CUDA side is pinned by what its conversion gives (0x7FFF for every NaN) and
that pattern is put through the same canonicalisation the device path runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.publisher import snapshot
from deltasync.publisher.device_snapshot import DeviceSnapshot
from deltasync.publisher.snapshot import Bf16Snapshot, bf16_view

# fp32 bits -> the bf16 bits every path must publish
TABLE = [
    (0x00000000, 0x0000, "+0"),
    (0x80000000, 0x8000, "-0"),
    (0x7F800000, 0x7F80, "+inf"),
    (0xFF800000, 0xFF80, "-inf"),
    (0x7FC00000, 0x7FC0, "quiet NaN"),
    (0xFFC00000, 0x7FC0, "negative quiet NaN: sign dropped"),
    (0x7FC12345, 0x7FC0, "quiet NaN with a payload"),
    (0xFFFFFFFF, 0x7FC0, "negative quiet NaN, all payload bits"),
    (0x7F800001, 0x7FC0, "signalling NaN, smallest payload"),
    (0xFFBFFFFF, 0x7FC0, "negative signalling NaN, largest payload"),
    (0x7F810000, 0x7FC0, "signalling NaN whose top 16 bits are a bf16 NaN"),
    (0x00000001, 0x0000, "smallest subnormal rounds to +0"),
    (0x80000001, 0x8000, "smallest negative subnormal rounds to -0"),
    (0x007FFFFF, 0x0080, "largest subnormal rounds up to the smallest normal"),
    (0x807FFFFF, 0x8080, "largest negative subnormal"),
    (0x00010000, 0x0001, "a bf16 subnormal, exact"),
    (0x00008000, 0x0000, "subnormal tie: down to even"),
    (0x00018000, 0x0002, "subnormal tie: up to even"),
    (0x3F800000, 0x3F80, "1.0"),
    (0x3F808000, 0x3F80, "tie: down to even"),
    (0x3F818000, 0x3F82, "tie: up to even"),
    (0xBF808000, 0xBF80, "negative tie: down to even"),
    (0xBF818000, 0xBF82, "negative tie: up to even"),
    (0x3F807FFF, 0x3F80, "just below a tie"),
    (0x3F808001, 0x3F81, "just above a tie"),
    (0x7F7F7FFF, 0x7F7F, "just below the tie under the largest bf16"),
    (0x7F7F8000, 0x7F80, "tie above the largest bf16: to even, +inf"),
    (0x7F7FFFFF, 0x7F80, "largest finite fp32 overflows to +inf"),
    (0xFF7FFFFF, 0xFF80, "smallest finite fp32 overflows to -inf"),
]


def fp32(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


def bf16_bits(tensor: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in tensor.reshape(-1).view(torch.int16).tolist()]


def tiled(repeat: int) -> tuple[torch.Tensor, list[int]]:
    """The table repeated: long enough to take torch's vectorised kernels, not only the scalar."""
    source = fp32([b for b, _, _ in TABLE] * repeat)
    return source, [w for _, w, _ in TABLE] * repeat


@pytest.mark.parametrize("repeat", [1, 37])
def test_the_conversion_follows_the_table(repeat):
    source, want = tiled(repeat)
    assert bf16_bits(snapshot.to_bf16(source)) == want


@pytest.mark.parametrize("repeat", [1, 37])
def test_the_host_view_follows_the_table(repeat):
    """What the host path hashes and scans (torch's own NaN here is 0xFFFF on AVX-512)."""
    source, want = tiled(repeat)
    assert bf16_bits(bf16_view(source)) == want


def test_the_windowed_host_copy_follows_the_table():
    """The conversion a device's host path runs window by window before the copy."""
    source, want = tiled(5)
    assert bf16_bits(snapshot.bf16_on_host(source.view(5, -1), window=7)) == want


def test_the_cuda_nan_pattern_is_canonicalised_to_the_same_bits():
    """CUDA's conversion gives 0x7FFF for every NaN, AVX-512's 0xFFFF, others keep a payload:
    what `to_bf16` does right after the conversion turns each into 0x7FC0."""
    theirs = [0x7FFF, 0xFFFF, 0xFFC0, 0x7F81, 0x7FC0, 0x7F80, 0x8000, 0x0001, 0x3F82]
    want = [0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0, 0x7F80, 0x8000, 0x0001, 0x3F82]
    converted = torch.tensor(np.array(theirs, dtype=np.uint16).view(np.int16))
    assert bf16_bits(snapshot.canonical_nan(converted.view(torch.bfloat16))) == want


def test_bf16_parameters_keep_their_bits():
    """No conversion, no rewrite: a bf16 NaN payload is the weight, and no copy is made."""
    tensor = torch.tensor(np.array([0x7FC1, 0xFFFF, 0x3F80], dtype=np.uint16).view(np.int16))
    tensor = tensor.view(torch.bfloat16)
    assert snapshot.to_bf16(tensor).data_ptr() == tensor.data_ptr()
    assert bf16_bits(bf16_view(tensor)) == [0x7FC1, 0xFFFF, 0x3F80]


@pytest.mark.parametrize("window", [1, 4, 1000])
def test_host_and_device_detection_agree_on_the_table(window):
    """Both detections, from a state of ones to the table and back: the same bits."""
    values, want = tiled(3)
    ones = {"t": torch.ones(values.numel())}
    host = Bf16Snapshot.capture(ones)
    device = DeviceSnapshot(Bf16Snapshot.capture(ones), "cpu", window=window)
    for state in ({"t": values}, ones):
        a, b = host.diff(state), device.diff(state)
        assert torch.equal(a.changes["t"].indices, b.changes["t"].indices)
        for field in ("values", "previous"):
            assert bf16_bits(getattr(a.changes["t"], field)) == bf16_bits(
                getattr(b.changes["t"], field)
            )
        assert a.digests == b.digests
        host.advance(a)
        device.advance(b)
    assert bf16_bits(device.diff({"t": values}).changes["t"].values) == [
        w for w in want if w != 0x3F80
    ]
