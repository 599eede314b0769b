"""`launch.py --local --containers`: the quick start with every Space in a container.

The same parts as `--local`, each started from the image its Space builds (`images`): the vLLM
replicas, the dashboard and, with `--env wordle`, the Wordle environment. The trainer runs on the
host, as a user's single-GPU trainer does. The bucket is a host folder mounted read-only into
the containers at its own path (the replica's `BUCKET` variable names it), and so is the built
model folder (the first version is a virtual anchor naming that path).

Network: the containers share a podman network of their own with DNS names (netavark and
aardvark), so the dashboard reaches `http://vllm-0:7860` by name as a Space reaches another by
address, and each container listens on its card's `app_port` as on Spaces. Host networking would
need per-container ports and would put the images' `0.0.0.0` listeners on every interface of the
host; here only the ports the host needs are published, on 127.0.0.1.

Variables reach a container in an `--env-file` (0600, removed when the run ends) and secrets
(DELTASYNC_API_KEY, the Wordle Space's ENV_API_KEY) as podman secrets, so no value is on a
command line or in `podman inspect`: podman 4.3 shows a secret of type env there like any
variable, so each is mounted as a file (uid 1000, 0400) and a one-line shell exports it before it
runs the image's own ENTRYPOINT and CMD, unchanged. The process the Space runs sees the same
variables as on Spaces. The replicas follow the bucket, as the Space's
entrypoint does by default; the trainer also pushes each version to them and verifies it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from deltasync import settings
from deltasync.defaults import SPACE_PORT
from deltasync.store.local import current_umask

from ..commands import shown
from ..config import LocalConfig, env_kind
from ..errors import LaunchError
from ..local import (
    LocalPlan,
    build_model,
    check_ports,
    finish_warm_up,
    local_plan,
    mark_latest,
    summarize,
)
from ..staging import REPO_ROOT
from ..supervisor import ProcessSpec, Supervisor
from .bases import ensure_bases
from .checks import check_conventions, check_required_variable
from .engine import Engine, EngineFailed, find_engine, prune_other_tags, remove_quietly
from .images import SpaceImage, build_space_image

__all__ = ["ContainerSpec", "container_specs", "run_containers"]

_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's docs run its image with --ipc=host or a larger --shm-size; its CPU engine asks for
# 160 MiB of /dev/shm with the local model. Spaces give a container more than podman's 64 MB.
_VLLM_SHM = "1g"
_SECRETS_DIR = "/run/secrets/deltasync"
# A secret that cannot be read ends the container (an empty key would mean "no auth" to Wordle).
_EXPORT_SECRETS = (
    f'for f in {_SECRETS_DIR}/*; do v=$(cat "$f") || exit 1; export "${{f##*/}}=$v"; done; '
    'exec "$@"'
)


@dataclass(frozen=True)
class ContainerSpec:
    """One Space as a container: its role (the process name), image kind, host port, settings."""

    role: str  # vllm-0, wordle, dashboard
    kind: str  # vllm, wordle, dashboard
    host_port: int
    variables: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)  # name -> value
    mounts: tuple[tuple[Path, bool], ...] = ()  # (host path, read-only)
    health_path: str = "/health"
    shm_size: str | None = None  # vLLM's engine needs more shared memory than podman's 64 MB


def container_specs(cfg: LocalConfig, plan: LocalPlan) -> list[ContainerSpec]:
    """Each Space's container, in `plan.services` order, with the settings its Space gets."""
    specs = []
    bucket = (plan.bucket, True)
    for service in plan.services:
        if service.name == "wordle":
            secrets = {"ENV_API_KEY": plan.api_key}
            specs.append(ContainerSpec("wordle", "wordle", cfg.env_port, {}, secrets))
        elif service.name == "dashboard":
            replicas = ",".join(f"http://{name}:{SPACE_PORT}" for name in plan.replica_urls)
            variables = {settings.BUCKET.name: str(plan.bucket), settings.REPLICAS.name: replicas}
            specs.append(
                ContainerSpec(
                    "dashboard", "dashboard", cfg.dashboard_port, variables, {}, (bucket,), "/"
                )
            )
        else:
            argv = service.argv
            model = argv[argv.index("--model") + 1]
            vllm_args = list(argv[argv.index("--") + 1 :])
            variables = {
                "MODEL": model,
                "BUCKET": str(plan.bucket),
                "VLLM_ARGS": _space_separated(vllm_args),
            }
            # launch.py's split of the cores, else the user's own (podman forwards no variable)
            if bind := service.env.get(_BIND_ENV) or os.environ.get(_BIND_ENV):
                variables[_BIND_ENV] = bind
            mounts = (bucket, *([(Path(model), True)] if os.path.isabs(model) else []))
            port = int(plan.replica_urls[service.name].rsplit(":", 1)[1])
            secrets = {settings.API_KEY.name: plan.api_key}
            specs.append(
                ContainerSpec(
                    service.name, "vllm", port, variables, secrets, mounts, shm_size=_VLLM_SHM
                )
            )
    return specs


def _space_separated(args: Sequence[str]) -> str:
    """`VLLM_ARGS` as the Space's entrypoint reads it: split on spaces, no quoting."""
    for arg in args:
        if not arg or any(c.isspace() or c in "'\"" for c in arg):
            raise LaunchError(
                f"--vllm-args {arg!r}: the vLLM Space splits VLLM_ARGS on spaces, so an "
                "argument cannot hold spaces or quotes"
            )
    return " ".join(args)


def check_readable(spec: ContainerSpec) -> None:
    """A container runs as uid 1000: every file it is given must be readable by others."""
    for path, _ in spec.mounts:
        if not path.exists():
            continue
        for item in (path, *path.rglob("*")):
            mode = item.stat().st_mode
            need = 0o005 if item.is_dir() else 0o004
            if mode & need != need:
                raise LaunchError(
                    f"{item} is not readable by other users, and {spec.role}'s container runs "
                    f"as uid 1000: chmod -R a+rX {path}"
                )


class _Resources:
    """What a run creates in the engine, removed when it ends, whatever happened."""

    def __init__(self, engine: Engine, run_id: str, folder: Path):
        self.engine = engine
        self.prefix = f"deltasync-{run_id}"
        self.network = self.prefix
        self.folder = folder
        self.containers: list[str] = []
        self.secrets: list[str] = []
        self.env_files: list[Path] = []

    def create_network(self) -> None:
        remove_quietly(self.engine, "network", [self.network])  # left by a killed run
        self.engine.run("network", "create", self.network)

    def prepare_container(self, spec: ContainerSpec, image: SpaceImage) -> list[str]:
        """The `engine run` command of `spec`, once its env file and secrets exist (a container
        of that name left by a killed run is removed first)."""
        name = f"{self.prefix}-{spec.role}"
        remove_quietly(self.engine, "container", [name])
        self.containers.append(name)
        argv = ["run", "--rm", "--name", name, "--network", self.network]
        argv += ["--network-alias", spec.role, "-p", f"127.0.0.1:{spec.host_port}:{image.app_port}"]
        argv += ["--shm-size", spec.shm_size] if spec.shm_size else []
        for path, read_only in spec.mounts:
            argv += ["-v", f"{path}:{path}{':ro' if read_only else ''}"]
        if spec.variables:
            argv += ["--env-file", str(self._env_file(spec.role, spec.variables))]
        return self.engine.command(*argv, *self._secrets(spec, image))

    def _env_file(self, role: str, values: Mapping[str, str]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{role}.env"
        path.unlink(missing_ok=True)  # a file left by a killed run keeps its own mode
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.writelines(f"{k}={v}\n" for k, v in values.items())
        self.env_files.append(path)
        return path

    def _secrets(self, spec: ContainerSpec, image: SpaceImage) -> list[str]:
        """Podman secrets mounted as files and exported by a one-line shell that then runs
        the image's own ENTRYPOINT and CMD unchanged (podman 4.3 shows the value of a secret
        of type env, like any variable, in `podman inspect`)."""
        if not spec.secrets:
            return [image.tag]
        if not self.engine.has_secrets:  # docker outside swarm: an env file (0600)
            env_file = self._env_file(f"{spec.role}-secrets", spec.secrets)
            return ["--env-file", str(env_file), image.tag]
        args = []
        for key, value in spec.secrets.items():
            name = f"{self.prefix}-{spec.role}-{key.lower()}"
            remove_quietly(self.engine, "secret", [name])
            self.engine.run("secret", "create", name, "-", stdin=value)
            self.secrets.append(name)
            target = f"{_SECRETS_DIR}/{key}"
            args += ["--secret", f"{name},type=mount,target={target},uid=1000,mode=0400"]
        entrypoint = json.dumps(["/bin/sh", "-c", _EXPORT_SECRETS, "deltasync-secrets"])
        return [*args, "--entrypoint", entrypoint, image.tag, *image.command]

    def remove(self) -> list[str]:
        """Remove everything, each step whatever the others did; returns what is still there
        afterwards (should be nothing)."""
        for path in self.env_files:
            path.unlink(missing_ok=True)
        steps = (("container", self.containers), ("network", [self.network]))
        for kind, names in (*steps, ("secret", self.secrets)):
            with contextlib.suppress(EngineFailed):
                remove_quietly(self.engine, kind, names)
        left = []
        for kind, names in (*steps, ("secret", self.secrets)):
            with contextlib.suppress(EngineFailed):
                left += [f"{kind} {n}" for n in names if self.engine.exists(kind, n)]
        return left


def _say(line: str) -> None:
    print(line, flush=True)  # builds take minutes: each line as it happens, also into a pipe


def run_containers(cfg: LocalConfig, echo: Callable[[str], None] = _say) -> int:
    """Build the images, run the Spaces as containers and the trainer here; the trainer's
    exit status (0: every version published and verified by the containerized replicas)."""
    engine = find_engine()
    plan = local_plan(cfg)
    plan = replace(plan, trainer=_trainer_for_containers(plan, cfg))
    specs = container_specs(cfg, plan)
    for warning in plan.warnings:
        echo(f"warning: {warning}")
    if cfg.dry_run:
        return _dry_run(engine, plan, specs, echo)
    check_ports(cfg)
    if (mask := current_umask()) & 0o004:
        raise LaunchError(
            f"umask {mask:03o} makes the bucket's files unreadable to other users, and the "
            "containers run as uid 1000: run with `umask 022`"
        )
    plan.bucket.mkdir(parents=True, exist_ok=True)
    mark_latest(plan.run_dir)
    started = time.monotonic()
    build_dir = plan.run_dir / "images"
    build_dir.mkdir(parents=True, exist_ok=True)
    bases = ensure_bases(engine, echo)
    images = {
        kind: build_space_image(engine, kind, build_dir, bases, echo)
        for kind in dict.fromkeys(s.kind for s in specs)
    }
    # children first: an image that another one is built on cannot be removed before it
    prune_other_tags(engine, [*(i.tag for i in images.values()), *(b.tag for b in bases.values())])
    check_required_variable(engine, images["vllm"], f"deltasync-{cfg.run_name}-check")
    resources = _Resources(engine, cfg.run_name, plan.run_dir / "settings")
    try:
        resources.create_network()
        code = _supervise(cfg, plan, specs, images, resources, engine, started)
    finally:
        left = resources.remove()
    if left:
        raise LaunchError(f"could not remove {', '.join(left)}; {engine.name} still lists them")
    for line in summarize(plan, cfg, time.monotonic() - started, code):
        echo(line)
    return code


def _supervise(cfg, plan, specs, images, resources, engine, started) -> int:
    services = {s.name: s for s in plan.services}
    with Supervisor(log_dir=plan.run_dir / "logs", cwd=REPO_ROOT, verbose=cfg.verbose) as sup:
        sup.say(f"logs {plan.run_dir / 'logs'} (every process's whole output)")
        sup.say(
            f"starting {', '.join(s.role for s in specs)} as {engine.name} containers on network "
            f"{resources.network}; the replicas follow the bucket (the Space entrypoint's default)"
        )
        procs = {
            s.role: _container_process(s, services[s.role], images[s.kind], resources)
            for s in specs
        }
        early = [sup.start(p) for role, p in procs.items() if not role.startswith("vllm-")]
        build_model(sup, plan, cfg)
        for spec in specs:
            check_readable(spec)
        replicas = [sup.start(p) for role, p in procs.items() if role.startswith("vllm-")]
        warm_up = sup.start(plan.warm_up)  # for the trainer here; each image compiles its own
        sup.wait_ready([*early, *replicas], cfg.startup_timeout_s)
        finish_warm_up(sup, warm_up)
        for spec in specs:
            sup.say(
                check_conventions(
                    engine, f"{resources.prefix}-{spec.role}", spec, images[spec.kind]
                )
            )
        sup.say(
            f"all healthy in {time.monotonic() - started:.0f} s; dashboard at "
            f"{plan.dashboard_url}; training {cfg.steps} steps"
        )
        return sup.wait_exit(sup.start(plan.trainer))


def _container_process(
    spec: ContainerSpec, service: ProcessSpec, image: SpaceImage, resources: _Resources
) -> ProcessSpec:
    """The local process's readiness and health checks, around `engine run` of its image."""
    return ProcessSpec(
        spec.role,
        tuple(resources.prepare_container(spec, image)),
        env=dict(resources.engine.env),
        ready_line=service.ready_line,
        ready_url=service.ready_url,
        stop_grace_s=service.stop_grace_s,
        health_url=service.health_url,
    )


def _trainer_for_containers(plan: LocalPlan, cfg: LocalConfig) -> ProcessSpec:
    """The host trainer; with Wordle it holds the key the Wordle container requires."""
    if env_kind(cfg.env) != "wordle":
        return plan.trainer
    return replace(plan.trainer, env={**plan.trainer.env, "ENV_API_KEY": plan.api_key})


def _dry_run(engine: Engine, plan: LocalPlan, specs: Sequence[ContainerSpec], echo) -> int:
    echo(
        f"would build {', '.join(dict.fromkeys(s.kind for s in specs))} and run (bucket "
        f"{plan.bucket}, logs {plan.run_dir / 'logs'}):"
    )
    for spec in specs:
        ports = f"127.0.0.1:{spec.host_port}"
        given = ", ".join([*spec.variables, *(f"{k} (secret)" for k in spec.secrets)])
        what = f"{engine.name} container of the {spec.kind} image"
        echo(f"  {spec.role}: {what} on {ports} ({given})")
    if plan.prepare is not None:
        echo(f"  $ {shown(plan.prepare.argv)}")
    echo(f"  $ {shown(plan.warm_up.argv)}")
    echo(f"  $ {shown(plan.trainer.argv)}")
    return 0
