"""`encode_anchor` checks what safetensors would refuse (or a silent copy would hide) first, as a
`FormatError` naming the tensor: strided views, shared memory, other dtypes, sparse tensors."""

from __future__ import annotations

import pytest
import torch

from deltasync.codec import ParsedFile, decode, encode_anchor
from deltasync.errors import FormatError


def _encode(tensors):
    return encode_anchor(tensors, run_id="r", version=1)


def _base() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)


@pytest.mark.parametrize(
    "make, tensor, match",
    [
        (lambda t: {"a": t, "b.t": t.t()}, "b.t", "contiguous"),
        (lambda t: {"a": t, "b": t[:, 2:4]}, "b", "contiguous"),
        (lambda t: {"a": t[:2], "b": t[2:]}, "b", "shares its memory with 'a'"),
        (lambda t: {"a": t.float()}, "a", "bf16 CPU"),
        (lambda t: {"a": t.float().to_sparse()}, "a", "dense"),
        (lambda t: {"a": [1, 2]}, "a", "dense"),
    ],
)
def test_what_safetensors_refuses_is_a_format_error_naming_the_tensor(make, tensor, match):
    with pytest.raises(FormatError, match=match) as info:
        _encode(make(_base()))
    assert info.value.tensor == tensor


def test_separate_contiguous_tensors_round_trip():
    """Empty tensors share no memory that matters; a row range of its own storage is fine."""
    t = _base()
    tensors = {"a": t.clone(), "b": t[1:].clone(), "empty": t[:0], "none": t[:0].clone()}
    decoded = decode(ParsedFile.parse(_encode(tensors))).tensors
    assert set(decoded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(decoded[name].view(torch.int16), tensor.view(torch.int16))
