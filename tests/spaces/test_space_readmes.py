"""Each Space README's front matter holds values the Hub accepts (read with huggingface_hub's own
card parser): a short description the Hub shows (at most 60 characters), a start-up timeout as a
duration, and the vLLM Space - slow to pull and load - sets both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from huggingface_hub.repocard import metadata_load

REPO = Path(__file__).resolve().parents[2]
READMES = sorted((REPO / "spaces").glob("*/README.md"))


@pytest.mark.parametrize("path", READMES, ids=lambda p: p.parent.name)
def test_front_matter_values_are_valid(path: Path):
    meta = metadata_load(path)
    assert meta and meta["sdk"] in ("docker", "gradio"), path
    if "short_description" in meta:
        assert isinstance(meta["short_description"], str)
        assert 0 < len(meta["short_description"]) <= 60, meta["short_description"]
    if "startup_duration_timeout" in meta:
        assert re.fullmatch(r"[1-9]\d*(m|h)", str(meta["startup_duration_timeout"]))
    if meta["sdk"] == "docker":
        assert isinstance(meta.get("app_port"), int)


def test_vllm_space_has_a_description_and_a_long_start_up():
    meta = metadata_load(REPO / "spaces" / "vllm" / "README.md")
    assert meta.get("short_description")
    timeout = str(meta.get("startup_duration_timeout"))
    minutes = int(timeout[:-1]) * (60 if timeout.endswith("h") else 1)
    assert minutes > 30  # the Hub's default, which a vLLM image and a model can outlast
