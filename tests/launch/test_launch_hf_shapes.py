"""The fake `hf` answers in the real CLI's shapes: run the real commands in-process on a stubbed
HfApi (no network) and read both answers with the launcher's own readers."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner
from huggingface_hub.cli.hf import app
from huggingface_hub.hf_api import SpaceInfo

from launcher.progress import space_url, stage_of
from launcher.spaces import _is_ours

HUB_PAYLOAD = {  # what the Hub's /api/spaces/{id} returns, trimmed
    "id": "alice/deltasync-vllm-0",
    "author": "alice",
    "sha": "abc123",
    "private": False,
    "sdk": "docker",
    "host": "https://alice-deltasync-vllm-0.hf.space",
    "subdomain": "alice-deltasync-vllm-0",
    "cardData": {"title": "x", "sdk": "docker", "tags": ["vllm", "deltasync"]},
    "tags": ["docker", "vllm", "deltasync", "region:us"],
    "runtime": {
        "stage": "RUNNING",
        "hardware": {"current": "a10g-small", "requested": "a10g-small"},
        "gcTimeout": None,
        "sha": "abc123",
    },
}


def _real(monkeypatch, module: str, argv: list[str], api: object) -> dict:
    monkeypatch.setattr(f"huggingface_hub.cli.{module}.get_hf_api", lambda token=None: api)
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _fake(hub, argv: list[str]) -> dict:
    proc = subprocess.run(["hf", *argv], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_spaces_info_shape(hub, monkeypatch):
    class Api:
        def space_info(self, repo_id, revision=None, expand=None):
            return SpaceInfo(**HUB_PAYLOAD)

    real = _real(
        monkeypatch, "spaces", ["spaces", "info", HUB_PAYLOAD["id"], "--format", "json"], Api()
    )
    hub.update(
        spaces={
            HUB_PAYLOAD["id"]: {
                "sdk": "docker", "private": False, "hardware": "a10g-small", "secrets": {},
                "variables": {}, "tags": ["vllm", "deltasync"], "sha": "abc123",
                "stage": "RUNNING", "stages": [],
            }
        }
    )  # fmt: skip
    fake = _fake(hub, ["spaces", "info", HUB_PAYLOAD["id"], "--format", "json"])
    for answer in (real, fake):
        assert stage_of(answer) == "RUNNING"
        assert space_url(answer, HUB_PAYLOAD["id"]) == HUB_PAYLOAD["host"]
        assert _is_ours(answer)
        assert answer["runtime"]["raw"]["sha"] == answer["sha"] == "abc123"
    assert set(fake) <= set(real) | {"card_data"}
    assert set(fake["runtime"]) <= set(real["runtime"])
    # an older commit still running reads as UPDATING
    stale = {**real, "sha": "def456"}
    assert stage_of(stale) == "UPDATING"


def test_whoami_shape(hub, monkeypatch):
    monkeypatch.setattr("huggingface_hub.cli.auth.get_token", lambda: "hf_x")
    monkeypatch.setattr(
        "huggingface_hub.cli.auth.whoami",
        lambda token: {"name": "alice", "orgs": [{"name": "team"}, {"name": "lab"}]},
    )
    result = CliRunner().invoke(app, ["auth", "whoami", "--format", "json"], catch_exceptions=False)
    real = json.loads(result.stdout)
    hub.update(orgs=["team", "lab"])
    fake = _fake(hub, ["auth", "whoami", "--format", "json"])
    assert real["user"] == fake["user"] == "alice"
    assert real["orgs"] == fake["orgs"] == "team,lab"


def test_repos_create_shape(hub, monkeypatch):
    from huggingface_hub.hf_api import RepoUrl

    class Api:
        def create_repo(self, **kwargs):
            return RepoUrl(
                "https://huggingface.co/spaces/alice/x", endpoint="https://huggingface.co"
            )

    argv = ["repos", "create", "alice/x", "--type", "space", "--sdk", "docker", "--format", "json"]
    real = _real(monkeypatch, "repos", argv, Api())
    fake = _fake(hub, argv)
    assert set(real) == set(fake) == {"repo_id", "url"} and real["repo_id"] == fake["repo_id"]


def test_version_shape(hub):
    real = subprocess.run(
        [sys.executable, "-m", "huggingface_hub.cli.hf", "version", "--format", "json"],
        capture_output=True,
        text=True,
        env={"HF_HUB_DISABLE_UPDATE_CHECK": "1", "PATH": "/usr/bin:/bin"},
    )
    assert set(json.loads(real.stdout)) == set(_fake(hub, ["version", "--format", "json"]))


def test_spaces_hardware_shape(hub, monkeypatch):
    """`hf spaces hardware` lists names, and an accelerator (or none) the launcher reads."""
    from huggingface_hub._jobs_api import JobHardwareInfo

    from launcher.plan import Hardware

    def row(name: str, accelerator: dict | None) -> JobHardwareInfo:
        return JobHardwareInfo(
            name=name, prettyName=name.upper(), cpu="4 vCPU", ram="15 GB",
            accelerator=accelerator, unitCostMicroUSD=16667, unitCostUSD=0.016667,
            unitLabel="minute",
        )  # fmt: skip

    a10g = {"type": "gpu", "model": "A10G", "quantity": "1", "vram": "24 GB", "manufacturer": "N"}

    class Api:
        def list_spaces_hardware(self):
            return [row("cpu-basic", None), row("a10g-small", a10g)]

    real = _real(monkeypatch, "spaces", ["spaces", "hardware", "--format", "json"], Api())
    fake = _fake(hub, ["spaces", "hardware", "--format", "json"])
    assert set(real[0]) == set(fake[0])
    assert Hardware.from_cli(real) == Hardware(
        ("cpu-basic", "a10g-small"), frozenset({"a10g-small"})
    )
    parsed = Hardware.from_cli(fake)
    assert "a10g-small" in parsed.gpu and "cpu-basic" in parsed.names
    assert "cpu-basic" not in parsed.gpu


def test_buckets_info_shape(hub, monkeypatch):
    from huggingface_hub._buckets import BucketInfo

    class Api:
        def bucket_info(self, bucket_id):
            return BucketInfo(
                id=bucket_id, private=True, createdAt="2026-01-02T03:04:05.000Z", size=0,
                totalFiles=0,
            )  # fmt: skip

    argv = ["buckets", "info", "alice/b", "--format", "json"]
    real = _real(monkeypatch, "buckets", argv, Api())
    hub.update(buckets={"alice/b": {"private": True}})
    fake = _fake(hub, argv)
    assert set(fake) <= set(real)
    assert real["private"] is fake["private"] is True


def test_piped_secrets_reach_the_hub_with_the_environment_ones(hub, monkeypatch):
    """What launch.py pipes (`--secrets-file -`) and names (`-s KEY`) both arrive, in the real
    CLI as in the fake, and the answer names the keys."""
    added: dict[str, str] = {}

    class Api:
        def add_space_secret(self, repo_id, key, value):
            added[key] = value

    monkeypatch.setenv("DELTASYNC_API_KEY", "from-env")
    monkeypatch.setattr("huggingface_hub.cli.spaces.get_hf_api", lambda token=None: Api())
    argv = ["spaces", "secrets", "add", "alice/x", "-s", "DELTASYNC_API_KEY", "--secrets-file", "-"]
    result = CliRunner().invoke(
        app, [*argv, "--format", "json"], input="HF_TOKEN=hf_read123\n", catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert added == {"DELTASYNC_API_KEY": "from-env", "HF_TOKEN": "hf_read123"}
    real = json.loads(result.stdout)

    hub.update(spaces={"alice/x": {"secrets": {}}})
    proc = subprocess.run(
        ["hf", *argv, "--format", "json"], input="HF_TOKEN=hf_read123\n", capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert hub.state["spaces"]["alice/x"]["secrets"] == added
    assert json.loads(proc.stdout) == real
