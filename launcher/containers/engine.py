"""The container engine: podman where it runs (tested here), docker where a daemon answers.

Podman runs with a configuration of ours (passed by `CONTAINERS_CONF` and
`CONTAINERS_STORAGE_CONF`, nothing in /etc changes): runc (crun refuses hybrid cgroups),
cgroupfs, default ulimits a machine without CAP_SYS_RESOURCE can grant, the netavark network
stack (its aardvark DNS lets containers reach each other by name, as Spaces do by address), and an
image store under the user's cache (`~/.cache/deltasync/containers`), outside any checkout, so a
clean clone on the same machine finds the images built before. Docker keeps its daemon's own store
and settings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import LaunchError

__all__ = [
    "INSTALL_COMMAND",
    "Engine",
    "EngineFailed",
    "EngineMissing",
    "find_engine",
    "image_size_mb",
    "output_lines",
    "prune_other_tags",
    "remove_quietly",
    "store_dir",
]

INSTALL_COMMAND = "bash scripts/install-containers.sh"
_CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
"""
_STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{graphroot}"
runroot = "{runroot}"
"""


class EngineMissing(LaunchError):
    """Neither podman nor a docker daemon can run containers here."""


class EngineFailed(LaunchError):
    """An engine command failed; the message carries its last lines."""


def store_dir() -> Path:
    """Where podman keeps images and our configuration: outside every checkout."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "deltasync" / "containers"


@dataclass(frozen=True)
class Engine:
    """One engine's executable and the environment its commands run with."""

    name: str  # podman | docker
    exe: str
    env: tuple[tuple[str, str], ...] = ()

    def command(self, *args: str) -> list[str]:
        return [self.exe, *args]

    def environ(self) -> dict[str, str]:
        return {**os.environ, **dict(self.env)}

    def run(
        self,
        *args: str,
        timeout_s: float = 120,
        stdin: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `engine args...`; raises `EngineFailed` with its output when it fails."""
        try:
            proc = subprocess.run(
                self.command(*args),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=self.environ(),
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise EngineFailed(
                f"{self.name} {args[0]} did not finish in {timeout_s:.0f} s"
            ) from None
        if check and proc.returncode != 0:
            raise EngineFailed(
                f"{self.name} {' '.join(args[:2])} failed (status {proc.returncode}):\n"
                + _last_lines(proc.stderr or proc.stdout)
            )
        return proc

    def exists(self, kind: str, name: str) -> bool:
        """Whether an image, container, network or secret (`kind`) of that name exists."""
        if self.name == "podman" and kind in ("image", "container", "network"):
            return self.run(kind, "exists", name, check=False).returncode == 0
        return self.run(kind, "inspect", name, check=False).returncode == 0

    @property
    def has_secrets(self) -> bool:
        """Podman keeps secrets (`podman secret`) and mounts them into a container as files;
        docker has them only in swarm mode."""
        return self.name == "podman"

    def untag(self, image: str, name: str) -> None:
        """Drop the name `name` of `image`, never the image itself (it keeps `image`)."""
        args = ("untag", image, name) if self.name == "podman" else ("image", "rm", name)
        self.run(*args, check=False)

    def build_flags(self) -> list[str]:
        """Never pull a base (the stand-ins are local); podman's `--format docker` keeps
        HEALTHCHECK, which its default OCI format drops. Docker's flags are unchecked here."""
        if self.name == "podman":
            return ["--format", "docker", "--pull=never"]
        return ["--pull=false"]


_NOISE = "unable to get systemd connection"  # podman without systemd, on every command


def output_lines(text: str) -> list[str]:
    """The non-empty lines of an engine's output, less podman's systemd noise."""
    return [x for x in (text or "").splitlines() if x.strip() and _NOISE not in x]


def _last_lines(text: str, n: int = 15) -> str:
    return "\n".join(f"    {x}" for x in output_lines(text)[-n:])


def _podman(exe: str) -> Engine:
    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    conf, storage = store / "containers.conf", store / "storage.conf"
    runroot = _private_dir(
        Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/deltasync-containers-{os.getuid()}")
    )
    _write_if_changed(conf, _CONTAINERS_CONF)
    _write_if_changed(
        storage, _STORAGE_CONF.format(graphroot=store / "storage", runroot=runroot / "podman")
    )
    return Engine(
        "podman",
        exe,
        (("CONTAINERS_CONF", str(conf)), ("CONTAINERS_STORAGE_CONF", str(storage))),
    )


def _private_dir(path: Path) -> Path:
    """A folder of this user's only (under /tmp another user could have made it first)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_symlink() or path.stat().st_uid != os.getuid():
        raise EngineFailed(f"{path} is not this user's folder: remove it, or set XDG_RUNTIME_DIR")
    path.chmod(0o700)
    return path


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def find_engine(which=shutil.which) -> Engine:
    """Podman if it, runc, netavark and iptables (netavark's firewall tool) are installed, else
    docker if its daemon answers; else `EngineMissing` naming what is missing and the command
    that installs it."""
    missing = []
    if podman := which("podman"):
        tools = {
            "runc": which("runc"),
            "netavark": _netavark(which),
            "iptables": which("iptables") or which("/usr/sbin/iptables"),
        }
        missing = [name for name, found in tools.items() if not found]
        if not missing:
            return _podman(podman)
    if docker := which("docker"):
        try:
            answered = subprocess.run(
                [docker, "info", "--format", "{{.ServerVersion}}"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            answered = None  # a daemon that does not answer in 20 s is not one to use
        if answered == 0:
            return Engine("docker", docker)
    verb = "is" if len(missing) == 1 else "are"
    what = (
        f"podman is installed but {' and '.join(missing)} {verb} not"
        if podman
        else "no container engine: podman is not installed and no docker daemon answers"
    )
    raise EngineMissing(f"--containers: {what}; install it with: {INSTALL_COMMAND}")


def _netavark(which) -> str | None:
    for folder in ("/usr/lib/podman", "/usr/libexec/podman", "/usr/local/lib/podman"):
        if Path(folder, "netavark").is_file():
            return str(Path(folder, "netavark"))
    return which("netavark")


def image_size_mb(engine: Engine, image: str) -> float:
    out = engine.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    return int(out or 0) / 1e6


def prune_other_tags(engine: Engine, tags: Sequence[str]) -> None:
    """Remove the images of each tag's repository under other tags, in the order given (an
    image's children first: one with children cannot go). A recipe or context that changed
    leaves its old image behind, which would otherwise pile up (GBs for vLLM); an image a
    container still uses stays (the engine refuses), as do the layers the new ones share."""
    listed = engine.run("images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout
    for tag in tags:
        repo = tag.rsplit(":", 1)[0]
        old = [name for name in listed.split() if name.rsplit(":", 1)[0] == repo and name != tag]
        if old:
            engine.run("rmi", *old, check=False, timeout_s=300)


def remove_quietly(engine: Engine, kind: str, names: Sequence[str]) -> None:
    """Remove containers (forced, no grace), networks or secrets; missing ones are fine."""
    if not names:
        return
    force = ("rm", "-f", "-t", "0") if engine.name == "podman" else ("rm", "-f")  # no grace
    args = {"container": force, "network": ("network", "rm", "-f")}
    cmd = args.get(kind, (kind, "rm"))
    engine.run(*cmd, *names, check=False, timeout_s=60)
