"""`scripts/gpu_check.sh --dry-run`: the one-shot GPU check's seven parts on CPU tensors.

The same script a lent GPU runs (issue 30), with `--device cpu --small`: every part must write
its JSON with its key figures and `ok: true`, and the script must exit 0. CUDA-only checks
(graphs, memory caps, transfer counts) are listed by each part as skipped, not faked.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("gpu", "gpu_detect", "gpu_commit", "gpu_graphs", "gpu_special", "gpu_digest", "gpu_fsdp")


def test_dry_run_runs_every_part_on_cpu_tensors(tmp_path):
    """As on the bare GPU machine, vLLM, zstandard and TRL cannot be imported by any part."""
    env = os.environ | {
        "PYTHONPATH": str(ROOT / "tests" / "no_torch_site"),
        "DELTASYNC_TEST_UNIMPORTABLE": "vllm,zstandard,trl",
    }
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    parts = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in PARTS}
    for name, result in parts.items():
        assert result["ok"] is True, (name, result.get("error"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["failed"] == 0
    assert set(summary["parts"]) == set(PARTS)

    (model,) = parts["gpu"]["models"]  # 1: reported steps after the warm-up
    assert [s["step"] for s in model["steps"]] == [1, 2]
    assert all(s["delta_bytes"] > 0 for s in model["steps"])
    # the table BENCHMARKS.md shows (bench.report checks it against the GPU run's JSON)
    assert parts["gpu"]["markdown"].startswith("| per step | qwen3-micro (0M) |\n|---|---:|")
    for name in ("gpu_detect", "gpu_commit", "gpu_digest", "gpu_fsdp"):  # the same, per part
        assert parts[name]["markdown"].startswith("| "), name

    detect = parts["gpu_detect"]  # 2: four densities, the host path once, equal diffs
    assert [r["target_density"] for r in detect["densities"]] == [0.005, 0.03, 0.15, 0.5]
    for row in detect["densities"]:
        assert abs(row["density"] - row["target_density"]) < 0.1 * row["target_density"] + 1e-3
        assert {"wall_s", "host_waits", "synchronize_calls", "bytes_to_host"} <= set(row["device"])
        assert {"wall_s", "host_waits", "bytes_to_host"} <= set(row["worker"])  # the copies
    (at_host,) = [r for r in detect["densities"] if "host" in r]
    assert at_host["host_equals_device"] and detect["host_path"]["wall_s"] > 0
    assert "crossover_density" in detect

    commit = parts["gpu_commit"]  # 3: three commits, only the changes written; a refusal
    assert [r["target_density"] for r in commit["deltas"]] == [0.01, 0.03, 0.1]
    for row in commit["deltas"]:
        assert row["commit"]["error"] is None and not row["commit"]["oom"]
        assert row["only_changes_written"] and row["new_values_held"]
        assert row["commit"]["pause_s"] > 0 and "bytes_to_host" in row["staging"]
    if commit["sink_takes_free_bytes"]:
        refused = commit["refused_when_short"]
        assert refused["error"] and refused["unchanged"]

    graphs = parts["gpu_graphs"]  # 4: both passes, graph == eager after every version
    assert [p["inference_mode_params"] for p in graphs["passes"]] == [False, True]
    assert graphs["graph_equals_eager"] is True and graphs["recompiles"] == 0
    for p in graphs["passes"]:
        assert len(p["versions"]) == 2
        assert all(v["compiled_bitwise"] and v["output_moved"] for v in p["versions"])

    special = parts["gpu_special"]  # 5: no mismatch, round to nearest even, NaNs stay NaN
    assert special["mismatches"] == [] and special["not_round_to_nearest_even"] == []
    assert special["nan_lost"] == [] and len(special["values"]) >= 20

    digest = parts["gpu_digest"]  # 6
    assert digest["checks"] == "ok" and digest["changed"] > 0

    fsdp = parts["gpu_fsdp"]  # 7: DTensor parameters, replica equal to the model
    assert "DTensor" in " ".join(fsdp["parameter_types"])
    assert fsdp["replica_equals_model"] and fsdp["replica_versions"] == [1, 2, 3]
