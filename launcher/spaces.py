"""Provision (and tear down) the bucket and Spaces of a launch with the `hf` CLI.

A launch: check the CLI and the login, check every hardware name against the Hub's list, create
the bucket, then for each Space create it (or duplicate a template owner's) with its hardware,
secrets and variables, upload its staged build context, and wait until it runs. A re-run
re-applies every setting of what exists, visibility included (both ways), since
`hf repos create --exist-ok` ignores them. A dry run needs no login: it shows the commands for
`--namespace`, or a placeholder. Names come from `plan.make_plan`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync import settings

from . import staging
from .config import SpacesConfig
from .errors import HubUnreachable, LaunchError, NameTaken, NotLoggedIn
from .hf import HfCli
from .plan import (
    API_KEY_SECRET,
    ENV_KEY_SECRET,
    FLAVOR_OPTIONS,
    MARKER_TAG,
    PLACEHOLDER_NAMESPACE,
    SDKS,
    TOKEN_SECRET,
    Hardware,
    Plan,
    SpaceSpec,
    make_plan,
)
from .progress import wait_running

__all__ = ["Account", "Deployment", "api_key_file", "deploy", "login", "teardown"]

_MAX_PROBED_REPLICAS = 64
_TOKEN = re.compile(r"[A-Za-z0-9_-]{8,}")


@dataclass(frozen=True)
class Deployment:
    plan: Plan
    hosts: dict[str, str]  # role -> https URL
    api_key: str
    api_key_file: Path | None


@dataclass(frozen=True)
class Account:
    """Whom a launch acts for; `user` is None in a dry run without a login (nothing is probed)."""

    namespace: str
    user: str | None


def login(hf: HfCli, namespace: str | None, echo: Callable[[str], None] = print) -> Account:
    """Check the CLI and the login; a dry run goes on without one."""
    hf.check_version()
    why = "not logged in"
    try:
        who = hf.query("auth", "whoami")
    except (NotLoggedIn, HubUnreachable) as exc:
        if not hf.dry_run:
            raise
        who = None
        if isinstance(exc, HubUnreachable):
            why = f"the Hub is unreachable ({exc.reason})"
    user = who.get("user") if isinstance(who, dict) else None
    if not user:
        if not hf.dry_run:
            raise NotLoggedIn(
                "not logged in to the Hugging Face Hub: run `hf auth login` and re-run"
            )
        shown = namespace or PLACEHOLDER_NAMESPACE
        echo(
            f"{why}: showing the commands of a first launch under {shown} (no Space or "
            "bucket is looked up); run `hf auth login` before a real launch"
        )
        return Account(shown, None)
    orgs = [o for o in str(who.get("orgs") or "").split(",") if o]
    if namespace and namespace not in (user, *orgs):
        member = f"orgs: {', '.join(orgs)}" if orgs else "no orgs"
        raise LaunchError(
            f"--namespace {namespace}: you are logged in as {user} ({member}); "
            "pass your user or one of your orgs"
        )
    return Account(namespace or user, user)


def _hardware(cfg: SpacesConfig, hf: HfCli, echo: Callable[[str], None]) -> Hardware:
    """The Hub's hardware names; a dry run that cannot reach the Hub goes on with the flavors
    asked for, unchecked, and says so."""
    try:
        return Hardware.from_cli(hf.query("spaces", "hardware"))
    except HubUnreachable as exc:
        if not hf.dry_run:
            raise
        flavors = (cfg.vllm_flavor, cfg.env_flavor, cfg.dashboard_flavor)
        gpu = frozenset() if cfg.vllm_flavor.startswith("cpu") else frozenset({cfg.vllm_flavor})
        taken = f"; {cfg.vllm_flavor} taken for a GPU" if gpu else ""
        echo(f"the Hub is unreachable ({exc.reason}): hardware names not checked{taken}")
        return Hardware(tuple(dict.fromkeys(flavors)), gpu)


def api_key_file(cfg: SpacesConfig, namespace: str) -> Path:
    return cfg.workdir / f"api-key-{namespace}-{cfg.name}"


def deploy(cfg: SpacesConfig, hf: HfCli, echo: Callable[[str], None] = print) -> Deployment:
    """Create or update everything, wait until every Space runs; returns their URLs."""
    account = login(hf, cfg.namespace, echo)
    hardware = _hardware(cfg, hf, echo)
    plan = make_plan(cfg, account.namespace, hardware.gpu)
    for spec in plan.spaces:  # before anything is made
        hardware.check(FLAVOR_OPTIONS[spec.kind], spec.flavor)
    piped = {spec.repo_id: _piped(spec, cfg) for spec in plan.spaces}
    key, key_file = _api_key(cfg, account.namespace, dry_run=hf.dry_run)
    # `-s DELTASYNC_API_KEY` (and the Wordle Space's `-s ENV_API_KEY`) read it from here, never
    # from argv
    hf.env[API_KEY_SECRET] = hf.env[ENV_KEY_SECRET] = key
    echo(f"bucket {plan.bucket_url}")
    probe = account.user is not None
    _bucket(hf, plan.bucket_id, cfg.private, probe=probe, echo=echo)
    existing = {spec.repo_id: _probe(hf, spec) if probe else None for spec in plan.spaces}
    message = _commit_message()
    staged: set[str] = set()
    for spec in plan.spaces:
        info = existing[spec.repo_id]
        echo(f"{spec.role}: {'updating' if info else 'creating'} {spec.repo_id} ({spec.flavor})")
        stdin = piped[spec.repo_id]
        if info is not None:
            _reapply(hf, spec, info, echo, stdin)
        elif cfg.from_template:
            args = (spec.template_id, spec.repo_id, *spec.create_args())
            hf.change("repos", "duplicate", *args, stdin=stdin)
        else:
            args = (spec.repo_id, "--sdk", spec.sdk, *spec.create_args())
            hf.change("repos", "create", *args, stdin=stdin)
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
    account = login(hf, cfg.namespace, echo)
    namespace = account.namespace
    plan = make_plan(cfg, namespace)
    found: list[str] = []
    if account.user is None:
        found = [_space_id(cfg, namespace, r) for r in _roles(cfg.replicas)]
        echo(f"(not logged in: a real teardown deletes only those that exist, tagged {MARKER_TAG})")
    else:
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


def _space_id(cfg: SpacesConfig, namespace: str, role: str) -> str:
    return f"{namespace}/{cfg.name}-{role}"


def _roles(replicas: int) -> list[str]:
    return [*(f"vllm-{i}" for i in range(replicas)), "wordle", "dashboard"]


def _existing(hf: HfCli, cfg: SpacesConfig, namespace: str) -> list[tuple[str, dict]]:
    """Every Space a launch under this name may have made and that exists: replicas until one
    is missing (at least --replicas of them probed), the Wordle env, the dashboard."""
    found = []
    for i in range(_MAX_PROBED_REPLICAS):
        repo_id = _space_id(cfg, namespace, f"vllm-{i}")
        info = hf.query_optional("spaces", "info", repo_id)
        if info is None and i >= cfg.replicas:
            break
        found.append((repo_id, info))
    for role in ("wordle", "dashboard"):
        repo_id = _space_id(cfg, namespace, role)
        found.append((repo_id, hf.query_optional("spaces", "info", repo_id)))
    return [(repo_id, info) for repo_id, info in found if info is not None]


def _bucket(
    hf: HfCli, bucket_id: str, private: bool, *, probe: bool, echo: Callable[[str], None]
) -> None:
    """Create the bucket, or give the existing one the visibility asked for (either way)."""
    info = hf.query_optional("buckets", "info", bucket_id) if probe else None
    if info is None:
        hf.change("buckets", "create", bucket_id, *(["--private"] if private else []), "--exist-ok")
    elif bool(info.get("private")) != private:
        echo(f"  bucket {bucket_id}: {_visibility(info.get('private'))} -> {_visibility(private)}")
        hf.change("buckets", "settings", bucket_id, "--private" if private else "--public")


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


def _reapply(
    hf: HfCli,
    spec: SpaceSpec,
    info: dict[str, Any],
    echo: Callable[[str], None],
    stdin: str | None,
) -> None:
    """Settings of an existing Space, which `repos create --exist-ok` would leave as they were."""
    hf.change("spaces", "settings", spec.repo_id, *spec.hardware_args())
    if bool(info.get("private")) != spec.private:
        echo(f"  visibility: {_visibility(info.get('private'))} -> {_visibility(spec.private)}")
        flag = "--private" if spec.private else "--public"
        hf.change("repos", "settings", spec.repo_id, "--type", "space", flag)
    if spec.secrets or spec.piped:
        hf.change("spaces", "secrets", "add", spec.repo_id, *spec.secret_args(), stdin=stdin)
    if spec.variables:
        pairs = [f"{k}={v}" for k, v in spec.variables]
        hf.change("spaces", "variables", "add", spec.repo_id, *_pairs("-e", pairs))


def _piped(spec: SpaceSpec, cfg: SpacesConfig) -> str | None:
    """The `--secrets-file -` input of a Space (dotenv lines), or None when it pipes nothing."""
    values = {TOKEN_SECRET: cfg.read_token}
    for key in spec.piped:
        if not _TOKEN.fullmatch(values[key] or ""):
            raise LaunchError(
                f"{settings.READ_TOKEN.name} is not a Hugging Face token (hf_..., letters and "
                "digits); unset it to give the Spaces the token you are logged in with"
            )
    return "".join(f"{key}={values[key]}\n" for key in spec.piped) or None


def _visibility(private: object) -> str:
    return "private" if private else "public"


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
