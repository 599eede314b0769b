"""The console's latency: per replica on each version's line (a superseded version says so
rather than showing a pause of 0), and p50 / p95 per replica at the end of the run."""

from __future__ import annotations

from test_console import _record

from deltasync.wire.metrics import ReplicaOutcome
from trainer.console import latency_summary, version_line


def test_version_line_shows_each_replicas_latency_and_pause():
    record = _record(
        replicas=(
            ReplicaOutcome("vllm-0", True, 1, 0.1, 0.04, 0.2, latency_s=1.2, served_version=7),
            ReplicaOutcome("follower-0", True, 1, latency_s=1.5, served_version=8, following=True),
            ReplicaOutcome("vllm-1", False, 2, error="down"),
        )
    )
    assert version_line(record).endswith(
        "| serving vllm-0 1.20 s (paused 0.04 s), follower-0 1.50 s (following), vllm-1 LAGGING"
    )


def test_a_superseded_version_says_so_instead_of_a_zero_pause():
    skipped = ReplicaOutcome("vllm-0", True, 1, latency_s=3.1, served_version=21)
    line = version_line(_record(version=4, replicas=(skipped,)))
    assert line.endswith("| serving vllm-0 3.10 s (superseded by v21: nothing applied)")
    assert "0.00 s" not in line


def test_latency_summary_is_p50_and_p95_per_replica():
    records = [
        _record(
            version=v,
            replicas=(
                ReplicaOutcome("vllm-0", True, 1, latency_s=float(v), served_version=v),
                ReplicaOutcome("vllm-1", False, 2, error="down")
                if v == 3
                else ReplicaOutcome("vllm-1", True, 1, latency_s=0.5, served_version=v),
            ),
        )
        for v in range(1, 21)
    ]
    assert latency_summary(records) == (
        "commit-to-serving latency p50 / p95: vllm-0 10.00 / 19.00 s, vllm-1 0.50 / 0.50 s"
    )
    assert latency_summary([_record()]) == ""  # a record without latencies
