"""The container engine and the three Space images, built once per session (and cached per
machine in the engine's store, so a later run reuses them; a fresh machine builds them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launcher.containers.bases import Base, ensure_bases  # noqa: E402
from launcher.containers.engine import Engine, find_engine  # noqa: E402
from launcher.containers.images import SpaceImage, build_space_image  # noqa: E402


@dataclass
class Built:
    engine: Engine
    bases: dict[str, Base]
    images: dict[str, SpaceImage]
    build_dir: Path
    lines: list[str]


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    engine = find_engine()  # EngineMissing says what to install: .ci/run installs it
    lines: list[str] = []
    build_dir = tmp_path_factory.mktemp("images")
    bases = ensure_bases(engine, lines.append)
    images = {
        kind: build_space_image(engine, kind, build_dir, bases, lines.append)
        for kind in ("wordle", "dashboard", "vllm")
    }
    yield Built(engine, bases, images, build_dir, lines)
