"""vLLM's CPU GEMM dispatch takes one of two paths, chosen by the CPU: with sgl-kernel or oneDNN
(AVX-512 machines) it packs the weight and empties `.weight`; without them it falls back to
`torch.nn.functional.linear` and keeps `.weight`. CI machines differ, so tests that depend on the
path run both (the `gemm_path` fixture in conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch


@contextmanager
def fallback_gemms() -> Iterator[None]:
    """vLLM's CPU GEMM dispatch as on a CPU without AVX-512: no packing kernel is available."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    with (
        mock.patch.object(ops, "_supports_onednn", False),
        mock.patch.object(utils, "check_cpu_sgl_kernel", lambda *args: False),
    ):
        yield


def dispatch_empties_weights() -> bool:
    """Whether vLLM's CPU GEMM dispatch, as it runs now, packs a weight and empties `.weight`."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    weight = torch.ones(128, 64, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, True)
    return layer.weight.numel() == 0
