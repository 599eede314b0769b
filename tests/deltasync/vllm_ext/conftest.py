"""Fixtures shared by the vLLM extension tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gemm_paths import fallback_gemms


@pytest.fixture(params=["native", "fallback"])
def gemm_path(request) -> Iterator[str]:
    """vLLM's CPU GEMM dispatch as this CPU runs it ("native"), or its unpacked fallback."""
    if request.param == "native":
        yield "native"
        return
    with fallback_gemms():
        yield "fallback"
