"""Command lines of the parts: trainer, vLLM replica, Wordle server, dashboard, built model."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "class_path_env",
    "dashboard_command",
    "interpreter",
    "prepare_command",
    "replica_command",
    "shown",
    "trainer_command",
    "verify_command",
    "wordle_command",
]

PY = sys.executable
_PREPARE = (
    "import sys; from trainer.config import prepare_model; "
    "print(prepare_model(sys.argv[1], sys.argv[2], seed=int(sys.argv[3])))"
)


def interpreter() -> str:
    """This interpreter as a person would type it: relative when it lies under the current
    folder (`.venv/bin/python`), else its full path. A bare `python` may be another one, without
    the packages the commands need."""
    path = os.path.relpath(PY)
    if path == os.pardir or path.startswith(os.pardir + os.sep):
        return PY
    return path if os.sep in path else os.path.join(os.curdir, path)  # `./python`, not PATH's


def shown(argv: Sequence[str]) -> str:
    """A command line for people to copy, run by the interpreter that runs the launcher."""
    return shlex.join([interpreter() if a == PY else a for a in argv])


def verify_command(bucket: str) -> list[str]:
    """Replays a bucket's chain of versions and checks every digest."""
    return [PY, "-m", "deltasync", "verify", bucket]


def trainer_command(
    *,
    model: str,
    bucket: str,
    urls: Sequence[str],
    env: str,
    env_url: str | None,
    steps: int,
    run_id: str,
    model_dir: Path | None = None,
    output_dir: Path | None = None,
    seed: int | None = None,
    verify: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """`python -m trainer.train ...`; `env` is the trainer's --env (sanity, wordle, openenv)."""
    cmd = [PY, "-m", "trainer.train", "--model", model]
    if model_dir is not None:
        cmd += ["--model-dir", str(model_dir)]
    cmd += ["--bucket", bucket, "--run-id", run_id, "--steps", str(steps), "--env", env]
    if env != "sanity" and env_url:
        cmd += ["--env-url", env_url]
    for url in urls:
        cmd += ["--vllm-server-url", url]
    if output_dir is not None:
        cmd += ["--output-dir", str(output_dir)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if verify:
        cmd.append("--verify-replicas")
    return cmd + list(extra)


def replica_command(model: str, bucket: str, port: int, vllm_args: Sequence[str]) -> list[str]:
    """A vLLM replica following the bucket on 127.0.0.1 (token from DELTASYNC_API_KEY)."""
    cmd = [PY, "-m", "deltasync.vllm_ext.serve", "--model", model, "--bucket", bucket]
    return [*cmd, "--port", str(port), "--", *vllm_args]


def wordle_command(port: int) -> list[str]:
    return [PY, "-m", "wordle_env.server", "--host", "127.0.0.1", "--port", str(port)]


def dashboard_command(bucket: str, port: int) -> list[str]:
    cmd = [PY, "-m", "spaces.dashboard.app", "--bucket", bucket]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port)]


def prepare_command(model: str, model_dir: Path, seed: int) -> list[str]:
    """Builds a random Qwen3 preset (`tiny`, `small`) offline, once per seed, in `model_dir`."""
    return [PY, "-c", _PREPARE, model, str(model_dir), str(seed)]


def warm_up_command(encoding: str) -> list[str]:
    """Compiles the codec's loops into numba's disk cache (`python -m deltasync warm-up`)."""
    return [PY, "-m", "deltasync", "warm-up", "--encoding", encoding]


def class_path_env(kind: str) -> dict[str, str]:
    """A session class (`--env package.module:Class`) is imported by the trainer, which runs
    in the repository: give it the folder launch.py was started from, then PYTHONPATH."""
    if ":" not in kind:  # a name or a URL's kind, not package.module:Class
        return {}
    paths = (os.getcwd(), os.environ.get("PYTHONPATH"))
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
