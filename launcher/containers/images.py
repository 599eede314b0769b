"""The Space images, built from exactly the files a Space receives.

Each context is staged by `launcher.staging.stage`, the code that stages it for `hf upload`, and
its Dockerfile is built unchanged (`--pull=never`, on the stand-in bases of `bases`). A Gradio-SDK
Space (the dashboard) has no Dockerfile of its own: it is built the way Spaces build one, from its
card (`gradio_dockerfile`). An image is tagged with a digest of what it is built from, so an
unchanged context is reused instead of built again.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.repocard import metadata_load

from ..staging import stage, tree_digest
from .bases import BUILD_TIMEOUT_S, Base, as_from
from .engine import Engine, EngineFailed, image_size_mb, output_lines

__all__ = ["BuildFailed", "SpaceImage", "build_space_image", "gradio_dockerfile", "space_card"]

_STEP = re.compile(r"^STEP (\d+/\d+): (.*)$")
_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", re.IGNORECASE | re.MULTILINE)


class BuildFailed(EngineFailed):
    """A Space image did not build; the message names the Dockerfile step that failed."""


@dataclass(frozen=True)
class SpaceImage:
    """A built Space image and what running it needs: its card's port, its command."""

    kind: str
    tag: str
    app_port: int
    size_mb: float
    built_s: float | None  # None: reused
    healthcheck: bool  # the image has a HEALTHCHECK (`podman healthcheck run` can run it)
    command: tuple[str, ...] = ()  # its ENTRYPOINT then CMD: what the container runs


def space_card(context: Path) -> dict:
    """The Space card's front matter (README.md at the context's root)."""
    return metadata_load(context / "README.md") or {}


def gradio_dockerfile(card: Mapping[str, object]) -> str:
    """How Spaces build a Gradio-SDK Space: the card's Python, its requirements.txt before the
    other files, `gradio==<sdk_version>`, uid 1000, and `python <app_file>` on port 7860."""
    python = str(card.get("python_version") or "3.10")
    sdk = card.get("sdk_version")
    if card.get("sdk") != "gradio" or not sdk:
        raise EngineFailed("a Gradio Space's card needs `sdk: gradio` and an `sdk_version`")
    return "\n".join(
        [
            f"FROM docker.io/library/python:{python}-slim",
            "ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \\",
            "    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860",
            "RUN useradd --uid 1000 --create-home --home-dir /home/user user",
            "WORKDIR /home/user/app",
            "COPY requirements.txt ./",
            f"RUN pip install --quiet gradio=={sdk} -r requirements.txt",
            "COPY --chown=1000:1000 . ./",
            "USER 1000",
            "ENV HOME=/home/user",
            "EXPOSE 7860",
            f'CMD ["python", "{card.get("app_file") or "app.py"}"]',
            "",
        ]
    )


def _digest(context: Path, *extra: str) -> str:
    """What an image is built from: the context's files, then `extra` (Dockerfile, base)."""
    return hashlib.sha256("\0".join((tree_digest(context), *extra)).encode()).hexdigest()[:12]


def build_space_image(
    engine: Engine,
    kind: str,
    build_dir: Path,
    bases: Mapping[str, Base],
    log: Callable[[str], None],
    *,
    context: Path | None = None,
) -> SpaceImage:
    """Stage `kind` into `build_dir/<kind>` (or build the given `context` as it is) and build
    it unless an image of the same inputs is here; `log` gets one line either way."""
    if context is None:
        context = stage(kind, build_dir / kind)
    card = space_card(context)
    dockerfile = context / "Dockerfile"
    generated = None
    if not dockerfile.is_file():
        generated = build_dir / f"{kind}.Dockerfile"
        generated.write_text(gradio_dockerfile(card))
        dockerfile = generated
    from_name = _from(dockerfile.read_text())
    base = bases.get(_qualified(from_name))
    if base is None:
        raise EngineFailed(f"the {kind} Dockerfile's FROM {from_name} has no stand-in base here")
    tag = f"localhost/deltasync/{kind}:{_digest(context, dockerfile.read_text(), base.tag)}"
    port = int(card.get("app_port") or 7860)
    if engine.exists("image", tag):
        image = _inspected(engine, kind, tag, port, None)
        log(f"image {kind}: reused {tag} ({image.size_mb:.0f} MB)")
        return image
    started = time.monotonic()
    args = ["build", *engine.build_flags(), "-t", tag]
    args += ["-f", str(dockerfile)] if generated else []
    build_log = build_dir / f"build-{kind}.log"
    with as_from(engine, base), build_log.open("w") as out:
        try:
            proc = subprocess.run(
                [*engine.command(*args), str(context)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=engine.environ(),
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BuildFailed(
                f"the {kind} image took over {BUILD_TIMEOUT_S:.0f} s to build (log: {build_log})"
            ) from None
    if proc.returncode != 0:
        raise BuildFailed(_failure(kind, build_log.read_text(errors="replace"), build_log))
    image = _inspected(engine, kind, tag, port, time.monotonic() - started)
    log(f"image {kind}: built in {image.built_s:.0f} s, {image.size_mb:.0f} MB ({tag})")
    return image


def _from(dockerfile: str) -> str:
    found = _FROM.search(dockerfile)
    if not found:
        raise EngineFailed("the Dockerfile has no FROM line")
    return found.group(1)


def _qualified(name: str) -> str:
    """`python:3.11-slim` as the engine names it: docker.io/library/python:3.11-slim."""
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"


def _failure(kind: str, text: str, log: Path) -> str:
    """`the <kind> image did not build: Dockerfile STEP 3/9 (COPY ...) failed: <error>`."""
    lines = output_lines(text)
    step = None
    for line in lines:
        if found := _STEP.match(line):
            step = found
    errors = [x for x in lines if x.startswith(("Error:", "error"))] or lines[-1:] or [""]
    error = errors[-1]
    where = f"Dockerfile STEP {step.group(1)} ({step.group(2)})" if step else "the build"
    return f"the {kind} image did not build: {where} failed: {error.strip()} (log: {log})"


def _inspected(engine: Engine, kind: str, tag: str, port: int, built_s: float | None) -> SpaceImage:
    """The image's size, whether it has a HEALTHCHECK, and the command it runs."""
    health = (
        "{{if .HealthCheck}}yes{{end}}"
        if engine.name == "podman"
        else ("{{if .Config.Healthcheck}}yes{{end}}")
    )
    fmt = f"{health}|{{{{json .Config.Entrypoint}}}}|{{{{json .Config.Cmd}}}}"
    has_check, entrypoint, cmd = engine.run("image", "inspect", "--format", fmt, tag).stdout.split(
        "|", 2
    )
    command = (*(json.loads(entrypoint) or ()), *(json.loads(cmd) or ()))
    size = image_size_mb(engine, tag)
    return SpaceImage(kind, tag, port, size, built_s, has_check.strip() == "yes", command)
