"""`--dry-run` prints exactly the `hf` calls a real run makes, runs only the read-only ones and
changes nothing (no Hub state, no staged files, no key file)."""

from __future__ import annotations

import pytest
from hf_grammar import parse_hf

MODEL = "Qwen/Qwen3-1.7B"
J = ["--format", "json"]
READ_ONLY = (
    ("version",),
    ("auth", "whoami"),
    ("spaces", "hardware"),
    ("spaces", "info"),
    ("buckets", "info"),
)


def _read_only(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if any(tuple(c[: len(p)]) == p for p in READ_ONLY)]


def _dry_then_real(hub, *args: str) -> None:
    before = hub.state
    key_file = hub.workdir / "api-key-alice-deltasync"
    had_key = key_file.exists()
    dry = hub.launch(*args, "--dry-run")
    assert dry.code == 0, dry.err
    printed = dry.commands()
    ran = hub.calls()
    assert ran and _read_only(ran) == ran  # only queries ran (not the polls of the wait)...
    assert _read_only(printed)[: len(ran)] == ran
    assert hub.state == before  # ...and nothing changed
    assert not (hub.workdir / "stage").exists() or had_key  # staged by the earlier launch
    assert key_file.exists() == had_key
    hub.clear_calls()
    real = hub.launch(*args)
    assert real.code == 0, real.err
    assert printed == hub.calls()


def test_dry_run_of_a_fresh_launch_matches_the_real_one(hub):
    _dry_then_real(hub, "--model", MODEL, "--no-train", "--replicas", "2")


def test_dry_run_of_a_rerun_matches_the_real_one(hub):
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    hub.clear_calls()
    _dry_then_real(hub, "--model", MODEL, "--no-train", "--private")


def test_dry_run_of_from_template_matches_the_real_one(hub):
    state = hub.state
    for role in ("vllm-0", "wordle", "dashboard"):
        state["spaces"][f"bob/deltasync-{role}"] = {
            "sdk": "gradio" if role == "dashboard" else "docker",
            "private": False,
            "hardware": "cpu-basic",
            "secrets": {},
            "variables": {},
            "tags": ["deltasync"],
            "sha": "f" * 40,
            "stage": "RUNNING",
            "stages": [],
        }
    hub.state = state
    _dry_then_real(hub, "--model", MODEL, "--no-train", "--from-template", "bob")


def test_dry_run_of_a_teardown_matches_the_real_one(hub):
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    hub.clear_calls()
    _dry_then_real(hub, "--teardown", "--yes")
    assert hub.state["spaces"] == {}


def test_dry_run_prints_the_trainer_command(hub):
    result = hub.launch("--model", MODEL, "--dry-run", "--run-name", "r7")
    assert result.code == 0
    assert "would train with:" in result.out
    assert "python -m trainer.train --model Qwen/Qwen3-1.7B --bucket hf://buckets/alice/" in (
        result.out
    )
    assert "--run-id r7" in result.out


@pytest.mark.parametrize("namespace", [None, "team"])
def test_dry_run_needs_no_login(hub, namespace):
    """Not logged in: the commands of a first launch under --namespace (or a placeholder), each
    one the real CLI accepts; only the version, login and hardware list are read."""
    hub.update(user=None)
    ns = ["--namespace", namespace] if namespace else []
    result = hub.launch("--model", MODEL, "--dry-run", *ns)
    assert result.code == 0, result.err
    shown = namespace or "your-namespace"
    assert f"not logged in: showing the commands of a first launch under {shown}" in result.out
    assert [c[:2] for c in hub.calls()] == [
        ["version", "--format"],
        ["auth", "whoami"],
        ["spaces", "hardware"],
    ]
    printed = result.commands()
    creates = [c[2] for c in printed if c[:2] == ["repos", "create"]]
    assert creates == [f"{shown}/deltasync-{r}" for r in ("vllm-0", "wordle", "dashboard")]
    assert ["buckets", "create", f"{shown}/deltasync-weights", "--exist-ok", *J] in printed
    for argv in printed:
        parse_hf(argv)
    assert f"--bucket hf://buckets/{shown}/deltasync-weights" in result.out
    assert hub.state["spaces"] == {} and hub.state["buckets"] == {}
    assert not hub.workdir.exists()  # no staged context, no key file


@pytest.mark.parametrize("logged_in", [False, True])
def test_dry_run_without_the_hub_prints_every_command(hub, logged_in):
    """Offline (no DNS for the Hub) the dry run's read-only queries fail; each says so in one
    line and every command is still printed, under a placeholder namespace, exit 0 (it exited
    1 on the CLI's squashed httpx traceback and printed no bucket or Space command)."""
    hub.update(offline=True, user="alice" if logged_in else None)
    result = hub.launch("--model", MODEL, "--dry-run")
    assert result.code == 0, result.err
    out = result.out
    reason = "[Errno -2] Name or service not known"
    assert f"the Hub is unreachable ({reason}): showing the commands of a first launch" in out
    assert f"the Hub is unreachable ({reason}): hardware names not checked; a10g-small" in out
    assert "Traceback" not in out + result.err and "httpx" not in out + result.err
    printed = result.commands()
    creates = [c[2] for c in printed if c[:2] == ["repos", "create"]]
    assert creates == [f"your-namespace/deltasync-{r}" for r in ("vllm-0", "wordle", "dashboard")]
    assert ["buckets", "create", "your-namespace/deltasync-weights", "--exist-ok", *J] in printed
    for argv in printed:
        parse_hf(argv)
    assert "would train with:" in out


def test_a_real_launch_without_the_hub_is_one_line(hub):
    hub.update(offline=True)
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 1
    assert result.err.strip().splitlines() == [
        "error: `hf auth whoami --format json` could not reach the Hub ([Errno -2] Name or "
        "service not known): check the network or a proxy (HTTPS_PROXY) and re-run"
    ]
    assert hub.state["spaces"] == {} and hub.state["buckets"] == {}


def test_teardown_dry_run_needs_no_login(hub):
    hub.update(user=None)
    result = hub.launch("--teardown", "--dry-run", "--namespace", "team", "--replicas", "2")
    assert result.code == 0, result.err
    deleted = [c[2] for c in result.commands() if c[1:2] == ["delete"]]
    assert deleted == [
        *(f"team/deltasync-{r}" for r in ("vllm-0", "vllm-1", "wordle", "dashboard")),
        "team/deltasync-weights",
    ]
    assert [c[:2] for c in hub.calls()] == [["version", "--format"], ["auth", "whoami"]]


def test_a_real_launch_still_needs_a_login(hub):
    hub.update(user=None)
    result = hub.launch("--model", MODEL, "--no-train", "--namespace", "team")
    assert result.code == 1 and "not logged in" in result.err
    assert hub.state["spaces"] == {} and hub.state["buckets"] == {}


@pytest.mark.parametrize("env", ["sanity", "wordle"])
def test_local_dry_run_prints_every_process_and_starts_none(hub, env):
    result = hub.launch("--local", "--env", env, "--replicas", "2", "--dry-run", "--steps", "3")
    assert result.code == 0, result.err
    lines = [x.strip() for x in result.out.splitlines() if x.strip().startswith("$ ")]
    assert len(lines) == (7 if env == "wordle" else 6)
    assert any("from trainer.config import prepare_model" in x for x in lines)
    assert any(x.endswith("-m deltasync warm-up --encoding ctx") for x in lines)
    assert any("wordle_env.server --host 127.0.0.1 --port 8002" in x for x in lines) == (
        env == "wordle"
    )
    assert any("deltasync.vllm_ext.serve" in x and "--port 8011" in x for x in lines)
    assert any("spaces.dashboard.app" in x and "--port 7860" in x for x in lines)
    trainer = lines[-1]
    assert "--steps 3" in trainer and "--verify-replicas" in trainer
    assert "--vllm-server-url http://127.0.0.1:8001 --vllm-server-url http://127.0.0.1:8011" in (
        trainer
    )
    assert not (hub.workdir).exists()
    assert hub.calls() == []
