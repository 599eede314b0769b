"""The dashboard is a Gradio SDK Space: its card, its requirements (the root's torch-free base
dependencies, pinned as the root pins them), and the staged context served by its own `app.py`
with the tensor side's packages unimportable, as the Space runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import gradio
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from server_process import free_port

from launcher.staging import stage

REPO = Path(__file__).resolve().parents[2]
ROOT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SPACE = REPO / "spaces" / "dashboard"
ROOT_TORCH = {
    canonicalize_name(Requirement(x).name) for x in ROOT["optional-dependencies"]["torch"]
}
# The tensor side's packages that Gradio does not bring along (it needs numpy).
BLOCKED = ("torch", "numba", "safetensors", "zstandard")
START_TIMEOUT_S = 120


def _front_matter() -> dict:
    text = (SPACE / "README.md").read_text()
    return yaml.safe_load(text.split("---")[1])


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(x) for x in lines if x.strip() and not x.lstrip().startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def test_card_is_a_gradio_sdk_space():
    card = _front_matter()
    assert card["sdk"] == "gradio" and card["app_file"] == "app.py"
    assert card["python_version"] == "3.11"  # a string: YAML would read 3.10 as 3.1
    pinned = Version(str(card["sdk_version"]))
    assert pinned.major == Version(gradio.__version__).major  # the Gradio the tests run
    dev = _requirements(ROOT["optional-dependencies"]["dev"])
    assert dev["gradio"].specifier.contains(pinned)
    assert "app_port" not in card and "deltasync" in card["tags"]


def test_requirements_are_the_root_base_dependencies_pinned_as_the_root_pins_them():
    space = _requirements((SPACE / "requirements.txt").read_text().splitlines())
    root = _requirements(ROOT["dependencies"])
    assert not set(space) & ROOT_TORCH, "the Space installs nothing of deltasync[torch]"
    assert set(space) == set(root), "the root's base dependencies changed: update the Space"
    for name, req in space.items():
        assert req.specifier == root[name].specifier, f"{req} but the root pins {root[name]}"


def test_context_layout(tmp_path):
    context = stage("dashboard", tmp_path / "dashboard")
    files = {p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()}
    assert {
        "app.py",
        "README.md",
        "requirements.txt",
        "BUILD_INFO.json",
        "deltasync/__init__.py",
        "deltasync/wire/metrics.py",
        "deltasync_dashboard/app.py",
    } <= files
    assert not any(f.startswith(("spaces/", "trainer/", "tests/")) for f in files)
    assert "Dockerfile" not in files and "pyproject.toml" not in files
    assert (context / "app.py").read_text() == (SPACE / "space_app.py").read_text()


def _publish(bucket: Path, versions: int) -> None:
    import torch

    from deltasync.publisher.publisher import Publisher, PublisherConfig
    from deltasync.store import LocalStore

    model = torch.nn.Linear(32, 32)
    with Publisher(LocalStore(str(bucket)), PublisherConfig(run_id="run-a")) as publisher:
        for _ in range(versions):
            publisher.publish(model).result(timeout=60)
            with torch.no_grad():
                model.weight.add_(1e-2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_staged_space_serves_without_torch(tmp_path):
    from gradio_client import Client

    context = stage("dashboard", tmp_path / "dashboard")
    bucket = tmp_path / "bucket"
    _publish(bucket, 3)
    port = free_port()
    code = (
        "import runpy, sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None\n"
        "sys.path.insert(0, '.')\n"
        "import deltasync\n"
        "assert deltasync.__file__.startswith(sys.argv[1]), deltasync.__file__\n"
        "sys.argv = ['app.py']\n"
        "runpy.run_path('app.py', run_name='__main__')\n"
    )
    env = {
        **os.environ,
        "DELTASYNC_BUCKET": str(bucket),
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    env.pop("PYTHONPATH", None)
    log = tmp_path / "space.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(context)],
            cwd=context,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        data = Client(url, verbose=False).predict(api_name="/series")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert data["state"] == "ok", data["message"]
    assert [v["version"] for v in data["versions"]] == [1, 2, 3]
    assert "Traceback" not in log.read_text()
