"""Rollouts spread over every local replica: each engine gets its own cores, the dashboard is told
the replicas, and the summary prints the completions each one answered (from trainer.log)."""

from __future__ import annotations

import pytest

from launcher.config import LocalConfig
from launcher.local import BIND_ENV, core_binds, local_plan, summarize
from trainer.routing import completions_line


@pytest.mark.parametrize(
    ("replicas", "cores", "binds"),
    [
        (1, [0, 1], [None]),  # one engine: vLLM's own auto leaves a core to its scheduler
        (2, [0, 1], ["0", "1"]),
        (2, [0, 1, 2, 3, 4, 5, 6, 7], ["0,1,2", "4,5,6"]),  # each keeps one for its scheduler
        (3, [2, 3, 5, 7, 8, 9], ["2", "5", "8"]),  # the affinity's cores, not 0..n
        (3, [0, 1, 2, 3, 4], ["0", "1", "3"]),  # uneven shares: 1, 2, 2
    ],
)
def test_engines_get_disjoint_cores(replicas, cores, binds):
    assert core_binds(replicas, cores) == (binds, None)


def test_fewer_cores_than_replicas_share_round_robin_with_one_warning():
    binds, warning = core_binds(3, [0, 1])
    assert binds == ["0", "1", "0"]
    assert warning is not None and "\n" not in warning
    assert warning.startswith("3 replicas on 2 cores: engines share cores round-robin")


def test_the_plan_binds_each_replica_and_warns_once(tmp_path, monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    plan = local_plan(LocalConfig(workdir=tmp_path, replicas=2), cores=[0, 1])
    replicas = [s for s in plan.services if s.name.startswith("vllm-")]
    assert [s.env[BIND_ENV] for s in replicas] == ["0", "1"] and plan.warnings == ()
    assert BIND_ENV not in plan.trainer.env  # the trainer is not pinned
    crowded = local_plan(LocalConfig(workdir=tmp_path, replicas=3), cores=[0, 1])
    assert len(crowded.warnings) == 1
    one = local_plan(LocalConfig(workdir=tmp_path), cores=[0, 1])
    assert BIND_ENV not in one.services[-1].env


def test_a_binding_from_the_environment_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(BIND_ENV, "0-1|2-3")
    plan = local_plan(LocalConfig(workdir=tmp_path, replicas=3), cores=[0])
    assert all(BIND_ENV not in s.env for s in plan.services) and plan.warnings == ()


def test_the_summary_prints_completions_per_replica(tmp_path):
    cfg = LocalConfig(workdir=tmp_path, run_name="r", replicas=2)
    plan = local_plan(cfg, cores=[0, 1])
    logs = plan.run_dir / "logs"
    logs.mkdir(parents=True)
    lines = summarize(plan, cfg, 60.0, 0)
    assert not any(line.startswith("rollouts:") for line in lines)  # no trainer.log: no line
    url0, url1 = plan.replica_urls["vllm-0"], plan.replica_urls["vllm-1"]
    line = completions_line({url0: 120, url1: 80})
    (logs / "trainer.log").write_text(f"12:00:00 trainer.auth_proxy: {line}\n")
    [rollouts] = [x for x in summarize(plan, cfg, 60.0, 0) if x.startswith("rollouts:")]
    assert rollouts == "rollouts:  vllm-0 120, vllm-1 80 completions; busiest 1.20x the mean"
