"""Frozen settings of a launch, built once by launch.py from its arguments and environment."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from trainer import defaults

__all__ = ["LocalConfig", "SpacesConfig", "check_name", "env_kind"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(value: str | None, what: str, max_len: int) -> None:
    """Hub names and run ids: letters, digits, `.`, `_`, `-`, starting with a letter or digit."""
    if value is not None and (not _NAME.fullmatch(value) or len(value) > max_len):
        raise ValueError(
            f"{what} {value!r}: use up to {max_len} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


_SESSION_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def env_kind(env: str) -> str:
    """The trainer's --env: `sanity`, `wordle`, `openenv` (an OpenEnv server's URL, given to
    the trainer as --env-url), or a `package.module:Class` session class itself."""
    if env in ("sanity", "wordle") or _SESSION_CLASS.fullmatch(env):
        return env
    if env.startswith(("http://", "https://")):
        return "openenv"
    raise ValueError(
        "--env must be sanity, wordle, an OpenEnv URL (http[s]://...) or a session class "
        f"(package.module:Class), not {env!r}"
    )


@dataclass(frozen=True)
class SpacesConfig:
    """A deployment on Hugging Face: bucket + Docker Spaces, then the trainer here."""

    model: str
    name: str = "deltasync"
    namespace: str | None = None
    bucket: str | None = None  # bucket name; default <name>-weights
    replicas: int = 1
    vllm_flavor: str = "a10g-small"
    sleep_time_s: int = 3600  # GPU replicas: idle seconds until the Hub sleeps them; -1 never
    env_flavor: str = "cpu-basic"
    dashboard_flavor: str = "cpu-basic"
    env: str = defaults.SPACES_ENV
    private: bool = False
    run_name: str = "run"
    from_template: str | None = None
    steps: int = defaults.SPACES_STEPS
    vllm_args: str = "--max-model-len 4096 --gpu-memory-utilization 0.85"
    train: bool = True
    wait_timeout_s: float = 1800.0
    poll_s: float = 10.0
    workdir: Path = Path("out/launch")
    trainer_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # settings.API_KEY, if set
    # settings.READ_TOKEN: a fine-grained read token for the Spaces that only read the bucket
    read_token: str | None = field(default=None, repr=False)
    hf_cli: str | None = None
    dry_run: bool = False


@dataclass(frozen=True)
class LocalConfig:
    """Every part as a process on this machine, a folder as the bucket, loopback only."""

    model: str = defaults.MODEL
    model_dir: Path = Path(defaults.MODEL_DIR)
    workdir: Path = Path("out/local")
    bucket: Path | None = None  # default <workdir>/<run>/bucket
    replicas: int = 1
    env: str = defaults.ENV
    run_name: str = "local"
    steps: int = defaults.STEPS
    vllm_port: int = defaults.VLLM_PORT  # replica i listens on vllm_port + 10 * i
    env_port: int = defaults.ENV_PORT
    dashboard_port: int = defaults.DASHBOARD_PORT
    vllm_args: str | None = None  # default: sized for the model (see local.py)
    startup_timeout_s: float = defaults.STARTUP_TIMEOUT_S
    trainer_args: tuple[str, ...] = ()
    api_key: str | None = None
    seed: int = 0
    dry_run: bool = False
    containers: bool = False  # every Space in a container built from its Dockerfile
    verbose: bool = False  # stream every process's raw output, not only one line per version

    @property
    def run_dir(self) -> Path:
        return self.workdir / self.run_name

    @property
    def bucket_dir(self) -> Path:
        return self.bucket or self.run_dir / "bucket"
