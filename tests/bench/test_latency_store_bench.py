"""`python -m bench.latency_store` stays runnable and counts what the store tests assert."""

from __future__ import annotations

import json

import pytest

from bench.latency_store import main


@pytest.mark.whole_machine  # a ratio of timings
def test_latency_store_bench_at_tiny_size(tmp_path, capsys) -> None:
    out = tmp_path / "latency.json"
    argv = ["--versions", "2", "--latencies-ms", "0", "20", "--poll-s", "0.1"]
    argv += ["--anchor-mb", "4", "--range-mb", "0.5", "--workdir", str(tmp_path)]
    assert main([*argv, "--json", str(out)]) == 0
    assert "| latency | publisher calls/delta |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    for run in result["runs"]:
        delta = run["versions"][-1]
        assert delta["kind"] == "delta"
        calls = (delta["publisher_calls"], delta["driven_calls"], delta["follower_calls"])
        assert calls == (3, 2, 2)  # the follower: its poll and the delta
        assert run["idle_poll_calls"] == 1
        # put, swap, then the manifest and the named delta at once
        assert run["driven_p50_s"] >= 3 * run["latency_ms"] / 1000
    cold = {(r["latency_ms"], r["streams"]): r for r in result["cold_starts"]}
    # the head (the first MiB, with the header), then the rest in ranges, one stream or eight
    ranges = 1 + -(-(cold[(0, 8)]["anchor_bytes"] - (1 << 20)) // 500_000)
    assert cold[(0, 1)]["calls"] == cold[(0, 8)]["calls"] == ranges > 1
    assert cold[(20, 8)]["seconds"] < cold[(20, 1)]["seconds"]
