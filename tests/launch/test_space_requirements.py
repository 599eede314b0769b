"""Each Docker Space's own pyproject.toml asks for what the repo's pyproject.toml asks for.

A Docker Space's pyproject.toml is the one launcher/staging.py stages at the root of its build
context: spaces/vllm/pyproject.toml, and wordle_env/pyproject.toml (OpenEnv's layout: the
environment folder is the Wordle Space's context). Its `[tool.deltasync-space]` table says which
root requirements apply to it: the root `[project] dependencies` or not, which root extras, and
which packages its base image provides (left unpinned there so the image's build is kept). Every
other package must be present with the root's exact specifier, and nothing else may be; the
Space's own extras must equal the root's of the same name. Everything is read from the two
files, so a change to the root (a new pin, a split into a core and extras) fails here until the
Spaces follow.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from launcher.staging import CONTEXTS, sources

REPO = Path(__file__).resolve().parents[2]
ROOT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# kind -> the pyproject.toml at the root of each Docker Space's staged context
SPACE_FILES = {
    kind: files["pyproject.toml"]
    for kind, files in ((kind, sources(kind)) for kind in sorted(CONTEXTS))
    if "Dockerfile" in files and "pyproject.toml" in files
}


def _by_name(requirements: list[str], where: str) -> dict[str, Requirement]:
    out: dict[str, Requirement] = {}
    for line in requirements:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in out or str(out[name]) == str(req), f"{where}: {name} pinned twice"
        out[name] = req
    return out


def _root_requirements(core: bool, extras: list[str]) -> dict[str, Requirement]:
    """The root's requirements for `core` and `extras`, its self-references (`deltasync[env]`)
    expanded."""
    own = canonicalize_name(ROOT["name"])
    lines = list(ROOT["dependencies"]) if core else []
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        known = ROOT.get("optional-dependencies", {})
        assert extra in known, f"the root pyproject.toml has no extra {extra!r} ({sorted(known)})"
        for line in known[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == own:
                todo.extend(req.extras)
            else:
                lines.append(line)
    return _by_name(lines, "root pyproject.toml")


def _same(space: dict[str, Requirement], root: dict[str, Requirement], where: str) -> None:
    missing = sorted(set(root) - set(space))
    extra = sorted(set(space) - set(root))
    assert not missing, f"{where} lacks {[str(root[n]) for n in missing]} (the root asks for them)"
    assert not extra, f"{where} asks for {extra}, which the root pyproject.toml does not"
    for name, req in space.items():
        want = root[name]
        assert (req.specifier, req.extras, req.marker) == (
            want.specifier,
            want.extras,
            want.marker,
        ), f"{where}: {req} but the root pins {want}"


def test_every_docker_space_with_a_pyproject_is_checked():
    assert set(SPACE_FILES) >= {"vllm", "wordle"}
    assert SPACE_FILES["wordle"] == REPO / "wordle_env" / "pyproject.toml"
    unstaged = set((REPO / "spaces").glob("*/pyproject.toml")) - set(SPACE_FILES.values())
    assert not unstaged, f"no Space builds these (a stale copy?): {sorted(unstaged)}"


@pytest.mark.parametrize("kind", SPACE_FILES)
def test_space_pins_what_the_root_pins(kind: str):
    path = SPACE_FILES[kind]
    data = tomllib.loads(path.read_text())
    where = str(path.relative_to(REPO))
    table = data.get("tool", {}).get("deltasync-space")
    assert table is not None, f"{where}: add a [tool.deltasync-space] table (see this test)"
    assert set(table) == {"root-dependencies", "root-extras", "image-provides"}, where
    root = _root_requirements(table["root-dependencies"], table["root-extras"])
    provided = {canonicalize_name(n) for n in table["image-provides"]}
    assert provided <= set(root), f"{where}: image-provides names no root requirement"
    space = data["project"]
    _same(
        _by_name(space.get("dependencies", []), where),
        {n: r for n, r in root.items() if n not in provided},
        where,
    )
    for extra, lines in space.get("optional-dependencies", {}).items():
        _same(_by_name(lines, where), _root_requirements(False, [extra]), f"{where} [{extra}]")
    assert SpecifierSet(space["requires-python"]) == SpecifierSet(ROOT["requires-python"]), where


def test_vllm_space_reads_hub_buckets_and_runs_the_compiled_codec():
    """`hf://buckets/...` needs huggingface_hub >= 1.6; the change scan and varints need numba."""
    data = tomllib.loads((REPO / "spaces/vllm/pyproject.toml").read_text())
    deps = _by_name(data["project"]["dependencies"], "spaces/vllm")
    assert not any(deps["huggingface-hub"].specifier.contains(v) for v in ("1.0", "1.5.9"))
    assert "numba" in deps
