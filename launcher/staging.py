"""Build contexts for the Spaces: a template folder (spaces/<kind>/) plus this repository's
packages, or, for an OpenEnv environment (wordle_env/), that folder plus its Space card.

Each context is a copy of the sources at this revision (nothing is installed from a moving
source), so the Space builds exactly what was tested here; `BUILD_INFO.json` records the git
commit and a digest of the staged files. Staging is deterministic: an unchanged tree stages to
the same bytes, and `hf upload` then has nothing to commit. `sources` says which repository file
each staged path comes from (the Space's Dockerfile, pyproject.toml, README.md) without staging.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path, PurePosixPath

from .errors import LaunchError
from .plan import MARKER_TAG

__all__ = ["CONTEXTS", "REPO_ROOT", "describe", "revision", "sources", "stage", "tree_digest"]

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_INFO = "BUILD_INFO.json"
# Not staged from a folder: what .gitignore ignores there (caches; the .venv `uv run --project
# wordle_env` makes; what a pip build leaves), and uv.lock, wordle_env's lock for OpenEnv's
# tooling (the Space image installs with pip).
_SKIP = (
    "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".hypothesis", ".venv", "build",
    "dist", "*.egg-info", "uv.lock",
)  # fmt: skip
# OpenEnv keeps an environment's Dockerfile in server/ and builds with the environment folder as
# the context; a Docker Space builds the Dockerfile at the root, so staging moves it there (as
# `openenv push` does) when no other entry puts one there.
_SERVER_DOCKERFILE = "server/Dockerfile"

# kind -> (repository path, path in the context); a folder is copied with its subfolders, later
# entries replacing earlier ones. The layouts are the ones each Space's README describes
# ("Build context").
CONTEXTS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm": (("spaces/vllm", "."), ("deltasync", "deltasync")),
    # OpenEnv's layout: the environment folder is the context, its server/Dockerfile at the root.
    "wordle": (("wordle_env", "."), ("spaces/wordle/README.md", "README.md")),
    # A Gradio SDK Space: app.py at the root, the sources imported from beside it.
    "dashboard": (
        ("spaces/dashboard/space_app.py", "app.py"),
        ("spaces/dashboard/README.md", "README.md"),
        ("spaces/dashboard/requirements.txt", "requirements.txt"),
        ("deltasync", "deltasync"),
        ("spaces/dashboard", "deltasync_dashboard"),
    ),
}


def describe(kind: str) -> str:
    """One line naming what goes into the context (for dry runs and progress)."""
    return " + ".join(src for src, _ in CONTEXTS[kind])


def sources(kind: str, root: Path = REPO_ROOT) -> dict[str, Path]:
    """The context of `kind` as {path in the context: the repository file staged there}."""
    if kind not in CONTEXTS:
        raise LaunchError(f"no Space template {kind!r}; known: {', '.join(sorted(CONTEXTS))}")
    found: dict[str, Path] = {}
    for src_rel, dst_rel in CONTEXTS[kind]:
        src, dst = root / src_rel, PurePosixPath(dst_rel)
        if not src.exists():
            raise LaunchError(f"cannot stage the {kind} Space: {src} is missing")
        if src.is_dir():
            for path in _tree(src):
                found[(dst / path.relative_to(src).as_posix()).as_posix()] = path
        else:
            found[dst.as_posix()] = src
    if "Dockerfile" not in found and _SERVER_DOCKERFILE in found:
        found["Dockerfile"] = found.pop(_SERVER_DOCKERFILE)
    return dict(sorted(found.items()))


def _tree(folder: Path) -> list[Path]:
    """The files under `folder`, less caches and uv.lock (`_SKIP`), in a fixed order."""
    files = []
    for here, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        files += [Path(here) / n for n in sorted(names) if not _skipped(n)]
    return files


def _skipped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in _SKIP)


def stage(kind: str, dest: Path, root: Path = REPO_ROOT) -> Path:
    """Write the build context of `kind` into `dest` (replaced), return `dest`."""
    files = sources(kind, root)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for rel, src in files.items():
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    readme = dest / "README.md"
    if readme.is_file():
        readme.write_text(_with_tag(readme.read_text(), MARKER_TAG))
    info = {"kind": kind, **revision(root), "files_sha256": tree_digest(dest)}
    (dest / BUILD_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return dest


def _with_tag(readme: str, tag: str) -> str:
    """The README with `tag` in its front matter's `tags:` list (launch.py's marker)."""
    lines = readme.split("\n")
    if not lines or lines[0].strip() != "---" or "---" not in (x.strip() for x in lines[1:]):
        raise LaunchError("a Space README must start with YAML front matter (---)")
    end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    front = lines[1:end]
    if any(x.strip() == f"- {tag}" for x in front):
        return readme
    at = next((i for i, x in enumerate(front) if x.startswith("tags:")), None)
    if at is None:
        front += ["tags:", f"  - {tag}"]
    elif front[at].strip() == "tags:":
        front.insert(at + 1, f"  - {tag}")
    else:  # inline list: tags: [a, b]
        inner = front[at].split(":", 1)[1].strip().strip("[]")
        items = [x.strip() for x in inner.split(",") if x.strip()]
        if tag in items:
            return readme
        front[at] = "tags: [" + ", ".join([*items, tag]) + "]"
    return "\n".join([lines[0], *front, *lines[end:]])


def tree_digest(folder: Path) -> str:
    """sha256 of every file's path and bytes under `folder`, in a fixed order."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def revision(root: Path) -> dict[str, object]:
    """Git commit of the sources and whether the working tree differs from it."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "modified": bool(status) if status is not None else None}
