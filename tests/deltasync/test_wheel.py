"""The built wheel holds every module of the repository's packages (a subpackage without an
`__init__.py`, or a package the `find` rule misses, would install without its code)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("deltasync", "trainer", "launcher", "bench", "wordle_env")


def test_the_wheel_holds_every_tracked_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("deltasync-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(
        ["git", "ls-files", "--", *(f"{p}/*.py" for p in PACKAGES)],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert (
        "deltasync/wire/manifest.py" in tracked
        and "deltasync/vllm_ext/server/_site/sitecustomize.py" in tracked
    )
    assert sorted(set(tracked) - held) == []
    packages = {str(Path(m).parent) for m in tracked if m.startswith("deltasync/")}
    assert sorted(p for p in packages if f"{p}/__init__.py" not in held) == []
