"""`launch.py --local --containers` without running containers: a machine without an engine gets
one line naming what is missing and the command that installs it, and nothing is created; the
plan gives each Space's container the settings its Space gets, secrets never on a command line.
(tests/containers/ builds the images and runs them.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import LocalConfig
from launcher.containers.engine import INSTALL_COMMAND, Engine, EngineMissing, find_engine
from launcher.containers.images import _failure, _qualified, gradio_dockerfile
from launcher.containers.run import _Resources, container_specs
from launcher.errors import LaunchError
from launcher.local import local_plan

REPO = Path(__file__).resolve().parents[2]


def test_no_engine_names_what_is_missing_and_the_install_command():
    with pytest.raises(EngineMissing) as err:
        find_engine(which=lambda name: None)
    assert "podman is not installed and no docker daemon answers" in str(err.value)
    assert str(err.value).endswith(f"install it with: {INSTALL_COMMAND}")

    installed = {"podman": "/usr/bin/podman", "netavark": "/usr/bin/netavark"}
    with pytest.raises(EngineMissing, match="but runc and iptables are not; install it"):
        find_engine(which=installed.get)
    # a slim machine has podman's packages but no iptables: every build step with a network
    # failed with "netavark: No such file or directory (os error 2)"
    installed["runc"] = "/usr/bin/runc"
    with pytest.raises(EngineMissing, match="podman is installed but iptables is not; install it"):
        find_engine(which=installed.get)


def test_launch_without_an_engine_says_so_in_one_line_and_changes_nothing(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin"), "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "--local",
            "--containers",
            "--workdir",
            str(work),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --containers: no container engine: podman is not installed and no docker daemon "
        f"answers; install it with: {INSTALL_COMMAND}"
    ]
    assert not work.exists() and not (tmp_path / "deltasync").exists()


def test_containers_need_local():
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--containers", "--model", "Qwen/Qwen3-0.6B"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--containers runs the Spaces here" in proc.stderr


def test_each_space_gets_its_settings_and_no_secret_reaches_a_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # set per xdist worker
    key = "k3y-that-must-stay-secret"
    cfg = LocalConfig(
        workdir=tmp_path, env="wordle", replicas=2, api_key=key, run_name="r", containers=True
    )
    plan = local_plan(cfg, cores=[0, 1])
    specs = {s.role: s for s in container_specs(cfg, plan)}
    assert list(specs) == ["wordle", "dashboard", "vllm-0", "vllm-1"]
    assert specs["wordle"].secrets == {"ENV_API_KEY": key} and not specs["wordle"].variables
    assert specs["dashboard"].variables == {
        "DELTASYNC_BUCKET": str(plan.bucket),
        "DELTASYNC_REPLICAS": "http://vllm-0:7860,http://vllm-1:7860",
    }
    replica = specs["vllm-1"]
    assert replica.variables["MODEL"] == str(cfg.model_dir.resolve())
    assert replica.variables["BUCKET"] == str(plan.bucket)
    assert replica.variables["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert replica.secrets == {"DELTASYNC_API_KEY": key}
    assert (cfg.model_dir.resolve(), True) in replica.mounts and replica.host_port == 8011

    calls = []

    class Recording(Engine):
        def run(self, *args, stdin=None, **kw):
            calls.append((args, stdin))
            return subprocess.CompletedProcess(args, 1, "", "")

    resources = _Resources(Recording("podman", "podman"), "r", tmp_path / "settings")
    from launcher.containers.images import SpaceImage

    command = ("/usr/local/bin/deltasync-entrypoint",)
    image = SpaceImage("vllm", "localhost/deltasync/vllm:x", 7860, 1.0, None, True, command)
    argv = resources.prepare_container(replica, image)
    assert key not in " ".join(argv)
    assert "127.0.0.1:8011:7860" in argv
    # the image's own command runs after the secrets are exported
    assert argv[-2:] == [image.tag, *command]
    secret = "deltasync-r-vllm-1-deltasync_api_key"
    target = "/run/secrets/deltasync/DELTASYNC_API_KEY"
    assert f"{secret},type=mount,target={target},uid=1000,mode=0400" in argv
    assert (("secret", "create", secret, "-"), key) in calls  # the value goes on stdin
    env_file = Path(argv[argv.index("--env-file") + 1])
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    assert key not in env_file.read_text() and "MODEL=" in env_file.read_text()
    resources.remove()
    assert not env_file.exists()


def test_gradio_space_is_built_from_its_card():
    card = {"sdk": "gradio", "sdk_version": "6.30.0", "python_version": "3.11", "app_file": "a.py"}
    text = gradio_dockerfile(card)
    assert text.startswith("FROM docker.io/library/python:3.11-slim\n")
    assert (
        text.index("COPY requirements.txt")
        < text.index("gradio==6.30.0")
        < text.index("COPY --chown")
    )
    assert 'CMD ["python", "a.py"]' in text and "USER 1000" in text
    with pytest.raises(Exception, match="sdk_version"):
        gradio_dockerfile({"sdk": "docker"})


def test_a_failed_build_names_its_dockerfile_step(tmp_path):
    log = "\n".join(
        [
            "STEP 1/9: FROM python:3.11-slim",
            "STEP 2/9: COPY missing.txt ./",
            'Error: building at STEP "COPY missing.txt ./": checking on sources: no such file',
        ]
    )
    message = _failure("wordle", log, tmp_path / "build.log")
    assert message.startswith(
        "the wordle image did not build: Dockerfile STEP 2/9 (COPY missing.txt ./) failed: Error:"
    )
    assert _qualified("python:3.11-slim") == "docker.io/library/python:3.11-slim"
    assert _qualified("vllm/vllm-openai:v0.32.0") == "docker.io/vllm/vllm-openai:v0.32.0"
    assert _qualified("localhost/x/y:1") == "localhost/x/y:1"


def test_vllm_args_that_the_space_cannot_split_are_refused(tmp_path, monkeypatch):
    """The vLLM Space splits VLLM_ARGS on spaces: a quoted argument would reach vLLM quoted."""
    cfg = LocalConfig(
        workdir=tmp_path, env="sanity", vllm_args="--compilation-config '{\"level\": 0}'"
    )
    with pytest.raises(LaunchError, match="cannot hold spaces or quotes"):
        container_specs(cfg, local_plan(cfg, cores=[0, 1]))
