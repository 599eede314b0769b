"""Spaces' conventions, checked in a running container: what the Hub expects of an image.

A Space runs its container as uid 1000 with a writable HOME, routes the card's `app_port`, and
reports the image's HEALTHCHECK; the vLLM image's entrypoint refuses to start, in one line, when
a required variable is missing. Each check raises `ConventionBroken` naming what is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import LaunchError
from .engine import Engine, EngineFailed, output_lines, remove_quietly

if TYPE_CHECKING:
    from .images import SpaceImage
    from .run import ContainerSpec

__all__ = ["ConventionBroken", "check_conventions", "check_required_variable"]

_PROBE = (
    "import sys, urllib.request; "
    "urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}', timeout=5)"
)


class ConventionBroken(LaunchError):
    """A container breaks a convention that Spaces rely on."""


def check_conventions(engine: Engine, name: str, spec: ContainerSpec, image: SpaceImage) -> str:
    """uid 1000, HOME writable, the app answering on the card's `app_port` inside the
    container, and the image's HEALTHCHECK passing; one line saying so."""

    def inside(*argv: str) -> str:
        proc = engine.run("exec", name, *argv, check=False, timeout_s=60)
        if proc.returncode != 0:
            raise ConventionBroken(
                f"{spec.role}: `{' '.join(argv)}` failed in its container: "
                f"{(proc.stderr or proc.stdout).strip()[-300:]}"
            )
        return proc.stdout.strip()

    uid = inside("id", "-u")
    if uid != "1000":
        raise ConventionBroken(f"{spec.role} runs as uid {uid}; Spaces run containers as uid 1000")
    home = inside("sh", "-c", 'test -w "$HOME" && echo "$HOME"')
    inside("python3", "-c", _PROBE, str(image.app_port), spec.health_path)
    health = "no HEALTHCHECK in the image"
    if image.healthcheck:
        health = "HEALTHCHECK passes"
        if engine.name == "podman":
            proc = engine.run("healthcheck", "run", name, check=False, timeout_s=60)
            if proc.returncode != 0:
                raise ConventionBroken(f"{spec.role}: its image's HEALTHCHECK fails")
        else:
            state = engine.run("inspect", "--format", "{{.State.Health.Status}}", name).stdout
            health = f"HEALTHCHECK {state.strip()}"
    return (
        f"{spec.role}: uid 1000, HOME {home} writable, answering on app_port "
        f"{image.app_port}, {health}"
    )


def check_required_variable(
    engine: Engine, image: SpaceImage, name: str, missing: str = "BUCKET"
) -> str:
    """Start the vLLM image (as container `name`) with `missing` left out: its entrypoint must
    exit non-zero with one line naming that variable (a Space shows that line as its runtime
    error). The container is removed whatever happens: were the entrypoint to start vLLM
    instead, it would otherwise keep running."""
    variables = {"MODEL": "Qwen/Qwen3-0.6B", "BUCKET": "hf://buckets/a/b"}
    variables.pop(missing, None)
    env = [x for k, v in variables.items() for x in ("--env", f"{k}={v}")]
    try:
        proc = engine.run(
            "run", "--rm", "--name", name, *env, image.tag, check=False, timeout_s=120
        )
    except EngineFailed:
        raise ConventionBroken(
            f"the vllm image started without {missing} and was still running after 120 s; its "
            "entrypoint must refuse to start without it"
        ) from None
    finally:
        remove_quietly(engine, "container", [name])
    lines = output_lines(proc.stderr + proc.stdout)
    if proc.returncode == 0 or len(lines) != 1 or missing not in lines[0]:
        raise ConventionBroken(
            f"the vllm image started without {missing}: expected a one-line error and a "
            f"non-zero exit, got status {proc.returncode} and {lines[-5:]}"
        )
    return lines[0]
