"""Each failure a user can meet ends in one line that says what to do, and changes nothing more."""

from __future__ import annotations

import click
import pytest

MODEL = "Qwen/Qwen3-1.7B"


def _one_error_line(result) -> str:
    lines = [x for x in result.err.splitlines() if x.strip()]
    assert len(lines) == 1, result.err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.err
    return lines[0]


def test_not_logged_in(hub):
    hub.update(user=None)
    result = hub.launch("--model", MODEL)
    assert result.code == 1
    assert "not logged in" in _one_error_line(result) and "hf auth login" in result.err
    assert [c[:2] for c in hub.calls()] == [["version", "--format"], ["auth", "whoami"]]


def test_payment_required_names_the_hardware_and_the_fix(hub):
    hub.update(paid_flavors=["a10g-small"])
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 1
    line = _one_error_line(result)
    assert "payment required for hardware 'a10g-small' for alice/deltasync-vllm-0" in line
    assert "https://huggingface.co/settings/billing" in line and "cpu-basic" in line
    assert hub.state["spaces"] == {}  # it stopped at the first refusal


def test_name_taken_by_a_space_launch_did_not_make(hub):
    hub.update(
        spaces={
            "alice/deltasync-dashboard": {
                "sdk": "gradio",
                "private": False,
                "hardware": "cpu-basic",
                "secrets": {},
                "variables": {},
                "tags": [],
                "sha": "a" * 40,
                "stage": "RUNNING",
                "stages": [],
            }
        }
    )
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 1
    line = _one_error_line(result)
    assert "alice/deltasync-dashboard exists and launch.py did not make it" in line
    assert "--name" in line
    assert not any(
        c[:2] in (["repos", "create"], ["upload", "alice/deltasync-vllm-0"]) for c in hub.calls()
    )
    assert hub.launch("--model", MODEL, "--no-train", "--name", "ds2").code == 0


def test_name_refused_by_the_hub(hub):
    """A 409 from `hf repos create` (e.g. created meanwhile by someone else)."""
    from launcher.errors import NameTaken
    from launcher.hf import _explain

    stderr = (
        "Error: Client error '409 Conflict' for url 'https://huggingface.co/api/repos/create'"
        "\n\nYou already created this space repo\n"
    )
    error = _explain(("repos", "create", "alice/x", "--type", "space"), stderr)
    assert isinstance(error, NameTaken) and "alice/x is taken" in str(error)


def test_namespace_not_yours(hub):
    result = hub.launch("--model", MODEL, "--no-train", "--namespace", "carol")
    assert result.code == 1 and "you are logged in as alice" in _one_error_line(result)


def test_no_write_access_to_the_namespace(hub):
    hub.update(writable=["alice"])  # a member of `team`, with a token that cannot write there
    result = hub.launch("--model", MODEL, "--no-train", "--namespace", "team")
    assert result.code == 1
    line = _one_error_line(result)
    assert "no permission for `hf buckets create team/deltasync-weights" in line
    assert "write access" in line


def test_hf_missing(hub, monkeypatch, tmp_path):
    result = hub.launch("--model", MODEL, "--hf-cli", str(tmp_path / "nowhere" / "hf"))
    assert result.code == 1
    line = _one_error_line(result)
    assert "hf CLI not found" in line and "pip install -U 'huggingface_hub>=2.4'" in line
    assert hub.calls() == []


def test_hf_missing_from_path(hub, monkeypatch, tmp_path):
    import launcher.hf

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(launcher.hf.sys, "executable", str(tmp_path / "py" / "python"))
    result = hub.launch("--model", MODEL)
    assert result.code == 1 and "hf CLI not found (no `hf` on PATH)" in _one_error_line(result)


@pytest.mark.parametrize("mode", ["1.3.0", "old"])
def test_hf_too_old(hub, mode):
    if mode == "old":  # a CLI that does not know --format at all
        hub.update(version_mode="old")
    else:
        hub.update(version=mode)
    result = hub.launch("--model", MODEL)
    assert result.code == 1
    line = _one_error_line(result)
    assert "is too old" in line and "needs hf >= 2.4" in line
    assert len(hub.calls()) == 1


def test_build_failure_shows_the_last_log_lines(hub):
    hub.update(
        stages_after_upload={"alice/deltasync-wordle": ["BUILDING", "BUILD_ERROR"]},
        build_logs={
            "alice/deltasync-wordle": [f"step {i}" for i in range(50)]
            + ["ERROR: No matching distribution found for openenv-core==9.9"]
        },
    )
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 1
    assert "alice/deltasync-wordle is in BUILD_ERROR" in _one_error_line(result)
    assert (
        "BUILDING" in result.out and "last build log lines of alice/deltasync-wordle" in result.out
    )
    assert "| ERROR: No matching distribution found for openenv-core==9.9" in result.out
    assert "| step 20" not in result.out  # only the last 30 lines
    assert [
        "spaces",
        "logs",
        "alice/deltasync-wordle",
        "--build",
        "-n",
        "30",
        "--format",
        "agent",
    ] in hub.calls()


@pytest.mark.parametrize(
    ("option", "value", "hint"),
    [
        ("--vllm-flavor", "a10g-smal", " (did you mean a10g-small?)"),
        ("--dashboard-flavor", "tpu-v9", ""),
        ("--env-flavor", "cpu-basik", " (did you mean cpu-basic?)"),
    ],
)
def test_unknown_hardware_is_refused_before_anything_is_made(hub, option, value, hint):
    """The CLI passes any --flavor on; the names are checked against `hf spaces hardware`."""
    result = hub.launch("--model", MODEL, "--no-train", option, value)
    assert result.code == 1
    line = _one_error_line(result)
    assert (
        f"{option} {value!r} is not Spaces hardware{hint}; valid: cpu-basic, cpu-upgrade," in line
    )
    assert line.endswith("a10g-small, a100-large")
    assert [c[:2] for c in hub.calls()] == [
        ["version", "--format"],
        ["auth", "whoami"],
        ["spaces", "hardware"],
    ]
    assert hub.state["spaces"] == {} and hub.state["buckets"] == {}
    assert not hub.workdir.exists()


def test_hardware_the_hub_lists_later_is_accepted(hub):
    """The list is the Hub's, not a copy: a flavor the Hub adds works without a launch.py change."""
    from hf_fake import HARDWARE

    hub.update(
        hardware=[
            *HARDWARE,
            ("h100x1", "Nvidia H100", "24 vCPU", "240 GB", "1x H100 (80 GB)", "$0.1", "$6"),
        ]
    )
    result = hub.launch("--model", MODEL, "--no-train", "--vllm-flavor", "h100x1")
    assert result.code == 0, result.err
    replica = hub.state["spaces"]["alice/deltasync-vllm-0"]
    assert replica["hardware"] == "h100x1" and replica["sleep_time"] == 3600


def test_bad_arguments_are_usage_errors(hub):
    assert hub.launch("--env", "chess").code == 2
    assert hub.launch("--model", MODEL, "--sleep-time", "0").code == 2
    assert hub.launch("--model", MODEL, "--sleep-time", "soon").code == 2
    assert hub.launch("--model", MODEL, "--name", "bad name").code == 2
    assert hub.launch("--model", "tiny").code == 2  # the tiny model is local only
    assert hub.launch().code == 2  # Spaces need --model
    assert hub.calls() == []


def test_grammar_check_is_not_vacuous():
    from hf_grammar import parse_hf

    path, params = parse_hf(["spaces", "settings", "a/b", "--hardware", "l4x1", "--format", "json"])
    assert path == "hf spaces settings" and params["hardware"] == "l4x1"
    with pytest.raises(click.ClickException):
        parse_hf(["spaces", "duplicate", "a/b"])  # there is no `hf spaces duplicate`
    with pytest.raises(click.ClickException):
        parse_hf(["repos", "create", "a/b", "--hardware", "l4x1"])  # create takes --flavor
    with pytest.raises(click.ClickException):
        parse_hf(["buckets", "delete", "--yes"])  # missing argument
