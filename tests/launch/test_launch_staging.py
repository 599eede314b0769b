"""Build contexts look like each Space README's "Build context", carry the marker tag, and are
deterministic; the plan names everything the same way every time."""

from __future__ import annotations

import json

import pytest

from launcher.config import SpacesConfig
from launcher.errors import LaunchError
from launcher.plan import SDKS, expected_host, make_plan
from launcher.staging import REPO_ROOT, _with_tag, sources, stage


def _files(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "vllm",
            {
                "Dockerfile",
                "README.md",
                "entrypoint.sh",
                "pyproject.toml",
                "deltasync/__init__.py",
                "deltasync/vllm_ext/serve.py",
            },
        ),
        (
            "wordle",  # OpenEnv's layout: the environment folder is the context
            {
                "Dockerfile",
                "README.md",
                "pyproject.toml",
                "openenv.yaml",
                "__init__.py",
                "server/app.py",
                "data/answers.txt",
            },
        ),
        (
            "dashboard",
            {
                "app.py",
                "README.md",
                "requirements.txt",
                "deltasync/__init__.py",
                "deltasync_dashboard/app.py",
            },
        ),
    ],
)
def test_context_layout(tmp_path, kind, expected):
    context = stage(kind, tmp_path / kind)
    files = _files(context)
    assert expected | {"BUILD_INFO.json"} <= files
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)
    assert not any(f.startswith(("trainer/", "tests/", "bench/")) for f in files)
    readme = (context / "README.md").read_text()
    assert readme.startswith("---\n") and "  - deltasync\n" in readme.split("---")[1]
    assert f"sdk: {SDKS[kind]}" in readme
    info = json.loads((context / "BUILD_INFO.json").read_text())
    assert info["kind"] == kind and len(info["files_sha256"]) == 64


def test_wordle_context_is_the_environment_folder_with_its_dockerfile_at_the_root(tmp_path):
    """As `openenv push` stages an OpenEnv environment: wordle_env/ as it is, less uv.lock (the
    image installs with pip), its server/Dockerfile moved to the root, and the Space card."""
    env = REPO_ROOT / "wordle_env"
    files = sources("wordle")
    assert files["Dockerfile"] == env / "server" / "Dockerfile"
    assert files["pyproject.toml"] == env / "pyproject.toml"
    assert files["README.md"] == REPO_ROOT / "spaces" / "wordle" / "README.md"
    assert "server/Dockerfile" not in files and "uv.lock" not in files
    from_env = {p for k, p in files.items() if k != "README.md"}
    assert from_env | {env / "uv.lock"} == {
        p for p in env.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    context = stage("wordle", tmp_path / "wordle")
    assert {p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()} == {
        *files,
        "BUILD_INFO.json",
    }
    assert (context / "Dockerfile").read_bytes() == files["Dockerfile"].read_bytes()


def test_staging_is_deterministic_and_replaces_old_files(tmp_path):
    first = (stage("wordle", tmp_path / "a") / "BUILD_INFO.json").read_text()
    (tmp_path / "a" / "stale.txt").write_text("from an older launch")
    again = stage("wordle", tmp_path / "a")
    assert (again / "BUILD_INFO.json").read_text() == first
    assert not (again / "stale.txt").exists()


def test_with_tag():
    block = "---\ntitle: x\ntags:\n  - vllm\n---\n\nbody\n"
    tagged = _with_tag(block, "deltasync")
    assert tagged == "---\ntitle: x\ntags:\n  - deltasync\n  - vllm\n---\n\nbody\n"
    assert _with_tag(tagged, "deltasync") == tagged
    assert _with_tag("---\ntitle: x\n---\nbody", "deltasync") == (
        "---\ntitle: x\ntags:\n  - deltasync\n---\nbody"
    )
    assert (
        _with_tag("---\ntags: [a, b]\n---\n", "deltasync") == "---\ntags: [a, b, deltasync]\n---\n"
    )
    assert _with_tag("---\ntags: [a, deltasync]\n---\n", "deltasync") == (
        "---\ntags: [a, deltasync]\n---\n"
    )
    with pytest.raises(LaunchError, match="front matter"):
        _with_tag("# no front matter\n", "deltasync")


def test_plan_names_and_settings():
    cfg = SpacesConfig(model="Qwen/Qwen3-1.7B", replicas=2, private=True, name="rl")
    plan = make_plan(cfg, "team")
    assert plan.bucket_url == "hf://buckets/team/rl-weights"
    assert [s.repo_id for s in plan.spaces] == [
        "team/rl-vllm-0",
        "team/rl-vllm-1",
        "team/rl-wordle",
        "team/rl-dashboard",
    ]
    vllm = plan.spaces[0]
    assert dict(vllm.variables)["BUCKET"] == "hf://buckets/team/rl-weights"
    assert vllm.secrets == ("HF_TOKEN", "DELTASYNC_API_KEY") and not vllm.private
    assert plan.spaces[-1].private and dict(plan.spaces[-1].variables) == {
        "DELTASYNC_BUCKET": "hf://buckets/team/rl-weights",
        "DELTASYNC_REPLICAS": "https://team-rl-vllm-0.hf.space,https://team-rl-vllm-1.hf.space",
    }
    sanity = make_plan(SpacesConfig(model="m", env="sanity", bucket="b"), "me")
    assert [s.role for s in sanity.spaces] == ["vllm-0", "dashboard"]
    assert sanity.bucket_id == "me/b"
    templated = make_plan(SpacesConfig(model="m", replicas=2, from_template="bob"), "me")
    assert [s.template_id for s in templated.spaces] == [
        "bob/deltasync-vllm-0",
        "bob/deltasync-vllm-0",
        "bob/deltasync-wordle",
        "bob/deltasync-dashboard",
    ]
    assert expected_host("Team/RL_x.y-vllm-0") == "https://team-rl-x-y-vllm-0.hf.space"
