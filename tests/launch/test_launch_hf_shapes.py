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
