"""Wordle as an OpenEnv package: OpenEnv's own ``openenv validate`` passes on the folder and on
running servers, the folder's pyproject.toml and uv.lock describe one package, and the Space
builds that folder (OpenEnv's layout: it is the build context, with server/Dockerfile)."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from launcher.staging import sources, stage

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "wordle_env"
PACKAGE = tomllib.loads((FOLDER / "pyproject.toml").read_text())
CLI_TIMEOUT_S = 120
_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")


def _validate(*args: str) -> tuple[int, dict[str, Any]]:
    """Run the installed openenv-core CLI, ``openenv validate ARGS --json``."""
    proc = subprocess.run(
        [sys.executable, "-m", "openenv.cli", "validate", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert proc.stdout.strip().startswith("{"), proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_openenv_validate_passes_on_the_folder() -> None:
    returncode, report = _validate(str(FOLDER), "--verbose")
    assert (returncode, report["passed"], report["issues"]) == (0, True, []), report
    modes = report["deployment_modes"]
    assert modes["openenv_serve"] and modes["uv_run"] and modes["python_module"], modes


@pytest.mark.parametrize("server", ["web_server", "uvicorn_server"])
def test_openenv_validate_passes_on_a_running_server(
    server: str, request: pytest.FixtureRequest
) -> None:
    """The Space's command with its web page, and ``uvicorn wordle_env.server.app:app``."""
    url = request.getfixturevalue(server).url
    returncode, report = _validate("--url", url)
    assert (returncode, report["passed"], report["mode"]) == (0, True, "simulation"), report
    assert report["summary"]["failed_criteria"] == []
    assert {c["id"] for c in report["criteria"]} >= {"health_endpoint", "mcp_endpoint"}


def test_the_space_installs_the_same_project() -> None:
    """The Space's context is this folder: its pyproject.toml, its server/Dockerfile."""
    staged = sources("wordle")
    assert staged["pyproject.toml"] == FOLDER / "pyproject.toml"
    assert staged["Dockerfile"] == FOLDER / "server" / "Dockerfile"
    assert {staged[name] for name in staged if name not in ("README.md", "Dockerfile")} == {
        FOLDER / name for name in staged if name not in ("README.md", "Dockerfile")
    }
    module, _, function = PACKAGE["project"]["scripts"]["server"].partition(":")
    assert getattr(importlib.import_module(module), function).__name__ == "main"


def test_uv_lock_matches_the_pyproject() -> None:
    """``uv lock`` again after changing the folder's [project]; this catches a stale lock."""
    lock = tomllib.loads((FOLDER / "uv.lock").read_text())
    project = PACKAGE["project"]
    assert lock["requires-python"] == project["requires-python"]
    (entry,) = [p for p in lock["package"] if p["name"] == project["name"]]
    assert entry["source"] == {"editable": "."}
    locked = {(r["name"], r.get("specifier", "")) for r in entry["metadata"]["requires-dist"]}
    wanted = {(r.name, str(r.specifier)) for r in map(Requirement, project["dependencies"])}
    assert locked == wanted
    versions = {p["name"]: p["version"] for p in lock["package"]}
    for requirement in map(Requirement, project["dependencies"]):
        assert requirement.specifier.contains(versions[requirement.name]), requirement


def test_manifest_names_the_module_app_and_the_space_port() -> None:
    manifest = yaml.safe_load((FOLDER / "openenv.yaml").read_text())
    assert manifest["name"] == "wordle_env" and manifest["spec_version"] == 1
    module, _, attribute = manifest["app"].partition(":")
    assert (module, attribute) == ("wordle_env.server.app", "app")
    front_matter = (REPO / "spaces/wordle/README.md").read_text().split("---")[1]
    assert yaml.safe_load(front_matter)["app_port"] == manifest["port"]


def _wheel(source: Path, out: Path) -> dict[str, bytes]:
    """Build ``source`` with pip (no network: no deps, this environment's setuptools)."""
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=CLI_TIMEOUT_S,
    )
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {
            name.split("/", 1)[-1] if ".dist-info/" in name else name: archive.read(name)
            for name in archive.namelist()
            if not name.endswith("/RECORD")
        }


@pytest.mark.slow
def test_folder_and_space_build_the_same_wheel(tmp_path: Path) -> None:
    """The folder (OpenEnv's layout: it is the package) and the Space's staged context, the
    folder with the Space card and the Dockerfile at its root, build the same wheel."""
    folder = shutil.copytree(FOLDER, tmp_path / "wordle_env", ignore=_CACHES)  # pip builds in place
    from_folder = _wheel(folder, tmp_path / "folder-wheel")
    from_space = _wheel(stage("wordle", tmp_path / "space"), tmp_path / "space-wheel")
    assert from_folder == from_space
    assert "wordle_env/openenv.yaml" in from_folder
    assert "wordle_env/data/answers.txt" in from_folder
    assert b"server = wordle_env.server.app:main" in from_folder["entry_points.txt"]
