"""Provision (and tear down) the bucket and Spaces of a launch with the `hf` CLI.

A launch: check the CLI and the login, create the bucket, then for each Space create it (or
duplicate a template owner's) with its hardware, secrets and variables, upload its staged build
context, and wait until it runs. A re-run re-applies every setting of Spaces that exist, since
`hf repos create --exist-ok` ignores them. Names come from `plan.make_plan`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import staging
from .config import SpacesConfig
from .errors import LaunchError, NameTaken, NotLoggedIn
from .hf import HfCli
from .plan import API_KEY_SECRET, MARKER_TAG, SDKS, Plan, SpaceSpec, make_plan
from .progress import wait_running

__all__ = ["Deployment", "api_key_file", "deploy", "login", "teardown"]

_MAX_PROBED_REPLICAS = 64


@dataclass(frozen=True)
class Deployment:
    plan: Plan
    hosts: dict[str, str]  # role -> https URL
    api_key: str
    api_key_file: Path | None


def login(hf: HfCli, namespace: str | None) -> str:
    """Check the CLI and the login; returns the namespace to use."""
    hf.check_version()
    who = hf.query("auth", "whoami")
    user = who.get("user") if isinstance(who, dict) else None
    if not user:
        raise NotLoggedIn("not logged in to the Hugging Face Hub: run `hf auth login` and re-run")
    orgs = [o for o in str(who.get("orgs") or "").split(",") if o]
    if namespace and namespace not in (user, *orgs):
        member = f"orgs: {', '.join(orgs)}" if orgs else "no orgs"
        raise LaunchError(
            f"--namespace {namespace}: you are logged in as {user} ({member}); "
            "pass your user or one of your orgs"
        )
    return namespace or user


def api_key_file(cfg: SpacesConfig, namespace: str) -> Path:
    return cfg.workdir / f"api-key-{namespace}-{cfg.name}"


def deploy(cfg: SpacesConfig, hf: HfCli, echo: Callable[[str], None] = print) -> Deployment:
    """Create or update everything, wait until every Space runs; returns their URLs."""
    namespace = login(hf, cfg.namespace)
    plan = make_plan(cfg, namespace)
    key, key_file = _api_key(cfg, namespace, dry_run=hf.dry_run)
    hf.env[API_KEY_SECRET] = key  # `-s DELTASYNC_API_KEY` reads it from here, never from argv
    echo(f"bucket {plan.bucket_url}")
    private = ["--private"] if cfg.private else []
    hf.change("buckets", "create", plan.bucket_id, *private, "--exist-ok")
    existing = {spec.repo_id: _probe(hf, spec) for spec in plan.spaces}
    message = _commit_message()
    staged: set[str] = set()
    for spec in plan.spaces:
        ours = existing[spec.repo_id] is not None
        echo(f"{spec.role}: {'updating' if ours else 'creating'} {spec.repo_id} ({spec.flavor})")
        if ours:
            _reapply(hf, spec)
        elif cfg.from_template:
            hf.change("repos", "duplicate", spec.template_id, spec.repo_id, *spec.create_args())
        else:
            hf.change("repos", "create", spec.repo_id, "--sdk", spec.sdk, *spec.create_args())
        if not cfg.from_template:
            context = cfg.workdir.resolve() / "stage" / spec.kind
            if spec.kind not in staged:  # the replicas share one context
                _stage(hf, spec.kind, context, echo)
                staged.add(spec.kind)
            hf.change(
                "upload", spec.repo_id, str(context), ".", "--type", "space",
                "--commit-message", message, "--delete", "*",
            )  # fmt: skip
    hosts = wait_running(
        hf, plan.spaces, timeout_s=cfg.wait_timeout_s, poll_s=cfg.poll_s, echo=echo
    )
    return Deployment(plan, hosts, key, key_file)


def teardown(
    cfg: SpacesConfig,
    hf: HfCli,
    confirm: Callable[[str], bool],
    echo: Callable[[str], None] = print,
    *,
    keep_bucket: bool = False,
) -> bool:
    """Delete the Spaces launch.py made under these names, and the bucket; False if declined."""
    namespace = login(hf, cfg.namespace)
    plan = make_plan(cfg, namespace)
    found: list[str] = []
    for repo_id, info in _existing(hf, cfg, namespace):
        if _is_ours(info):
            found.append(repo_id)
        else:
            echo(f"skipping {repo_id}: it has no '{MARKER_TAG}' tag, launch.py did not make it")
    what = [f"Space {r}" for r in found] + ([] if keep_bucket else [f"bucket {plan.bucket_id}"])
    if not what:
        echo("nothing to delete")
        return True
    echo("to delete:\n" + "\n".join(f"  {w}" for w in what))
    runs = "" if keep_bucket else " (the bucket with every run in it)"
    question = f"Delete these {len(what)}{runs}? [y/N] "
    if not hf.dry_run and not confirm(question):
        echo("nothing deleted")
        return False
    for repo_id in found:
        hf.change("repos", "delete", repo_id, "--type", "space", "-y", "--missing-ok")
    if not keep_bucket:
        hf.change("buckets", "delete", plan.bucket_id, "-y", "--missing-ok")
    key_file = api_key_file(cfg, namespace)
    if not hf.dry_run and key_file.exists():
        key_file.unlink()
    return True


def _stage(hf: HfCli, kind: str, context: Path, echo: Callable[[str], None]) -> None:
    if hf.dry_run:
        echo(f"  (would stage {staging.describe(kind)} into {context})")
    else:
        staging.stage(kind, context)


def _existing(hf: HfCli, cfg: SpacesConfig, namespace: str) -> list[tuple[str, dict]]:
    """Every Space a launch under this name may have made and that exists: replicas until one
    is missing (at least --replicas of them probed), the Wordle env, the dashboard."""
    found = []
    for i in range(_MAX_PROBED_REPLICAS):
        repo_id = f"{namespace}/{cfg.name}-vllm-{i}"
        info = hf.query_optional("spaces", "info", repo_id)
        if info is None and i >= cfg.replicas:
            break
        found.append((repo_id, info))
    for role in ("wordle", "dashboard"):
        repo_id = f"{namespace}/{cfg.name}-{role}"
        found.append((repo_id, hf.query_optional("spaces", "info", repo_id)))
    return [(repo_id, info) for repo_id, info in found if info is not None]


def _probe(hf: HfCli, spec: SpaceSpec) -> dict[str, Any] | None:
    """The Space's info if it exists and is ours; NameTaken if someone else's has the name."""
    info = hf.query_optional("spaces", "info", spec.repo_id)
    if info is not None and not _is_ours(info):
        raise NameTaken(
            f"{spec.repo_id} exists and launch.py did not make it (no '{MARKER_TAG}' tag): "
            "pass another --name, or delete that Space",
            argv=("spaces", "info", spec.repo_id),
        )
    return info


def _is_ours(info: dict[str, Any]) -> bool:
    card = info.get("card_data") or {}
    tags = [*(info.get("tags") or []), *(card.get("tags") or [])]
    return info.get("sdk") in (None, *SDKS.values()) and MARKER_TAG in tags


def _reapply(hf: HfCli, spec: SpaceSpec) -> None:
    """Settings of an existing Space, which `repos create --exist-ok` would leave as they were."""
    hf.change("spaces", "settings", spec.repo_id, "--hardware", spec.flavor)
    if spec.private:
        hf.change("repos", "settings", spec.repo_id, "--type", "space", "--private")
    if spec.secrets:
        hf.change("spaces", "secrets", "add", spec.repo_id, *_pairs("-s", spec.secrets))
    if spec.variables:
        pairs = [f"{k}={v}" for k, v in spec.variables]
        hf.change("spaces", "variables", "add", spec.repo_id, *_pairs("-e", pairs))


def _pairs(flag: str, values: Any) -> list[str]:
    return [x for v in values for x in (flag, v)]


def _api_key(cfg: SpacesConfig, namespace: str, *, dry_run: bool) -> tuple[str, Path | None]:
    """The replicas' bearer token: $DELTASYNC_API_KEY, else the one saved by an earlier launch,
    else a new one saved (mode 600) for the next launch and for running the trainer by hand."""
    if cfg.api_key:
        return cfg.api_key, None
    path = api_key_file(cfg, namespace)
    if path.is_file():
        return path.read_text().strip(), path
    key = secrets.token_urlsafe(32)
    if not dry_run:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(key + "\n")
    return key, path


def _commit_message() -> str:
    commit = staging.revision(staging.REPO_ROOT).get("commit")
    return f"launch.py: deploy deltasync {str(commit)[:12]}" if commit else "launch.py: deploy"
