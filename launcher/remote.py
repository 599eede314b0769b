"""After the Spaces run: print where everything is, then train here against them."""

from __future__ import annotations

from collections.abc import Callable

from deltasync import settings

from .commands import class_path_env, shown, trainer_command
from .config import SpacesConfig, env_kind
from .hf import HfCli
from .spaces import Deployment, deploy
from .staging import REPO_ROOT
from .supervisor import ProcessSpec, Supervisor

__all__ = ["run_spaces", "spaces_trainer_command"]


def spaces_trainer_command(cfg: SpacesConfig, dep: Deployment) -> list[str]:
    kind = env_kind(cfg.env)
    env_url = dep.hosts.get("wordle") if kind == "wordle" else None
    env_url = cfg.env if kind == "openenv" else env_url
    return trainer_command(
        model=cfg.model,
        bucket=dep.plan.bucket_url,
        urls=[dep.hosts[s.role] for s in dep.plan.replicas()],
        env=kind,
        env_url=env_url,
        steps=cfg.steps,
        run_id=cfg.run_name,
        extra=cfg.trainer_args,
    )


def run_spaces(cfg: SpacesConfig, hf: HfCli, echo: Callable[[str], None] = print) -> int:
    """Deploy (or update), report the URLs, then run the trainer unless --no-train."""
    dep = deploy(cfg, hf, echo)
    width = max(len(s.role) for s in dep.plan.spaces)
    echo("Spaces:" if not hf.dry_run else "Spaces (URLs the Hub assigns):")
    for spec in dep.plan.spaces:
        page = f"https://huggingface.co/spaces/{spec.repo_id}"
        echo(f"  {spec.role:<{width}}  {dep.hosts[spec.role]}   ({page})")
    echo(f"  {'bucket':<{width}}  {dep.plan.bucket_url}")
    cmd = spaces_trainer_command(cfg, dep)
    # With $DELTASYNC_API_KEY set there is no key file: the variable is already in the shell.
    key_hint = f"{settings.API_KEY.name}=$(cat {dep.api_key_file}) " if dep.api_key_file else ""
    if key_hint and env_kind(cfg.env) == "wordle":  # the Wordle Space wants the same key
        key_hint += f"ENV_API_KEY=$(cat {dep.api_key_file}) "
    if hf.dry_run or not cfg.train:
        echo("train with:" if not hf.dry_run else "would train with:")
        echo(f"  $ {key_hint}{shown(cmd)}")
        return 0
    echo(f"training: {shown(cmd)}")
    env = {
        settings.API_KEY.name: dep.api_key,
        **({"ENV_API_KEY": dep.api_key} if env_kind(cfg.env) == "wordle" else {}),
        "TRL_EXPERIMENTAL_SILENCE": "1",
        **class_path_env(env_kind(cfg.env)),
    }
    with Supervisor(cwd=REPO_ROOT, verbose=False) as sup:  # the trainer's console lines only
        trainer = sup.start(
            ProcessSpec("trainer", tuple(cmd), env=env, stop_grace_s=30, console=True)
        )
        code = sup.wait_exit(trainer)
    echo(f"trainer exited with status {code}; dashboard: {dep.hosts['dashboard']}")
    return code
