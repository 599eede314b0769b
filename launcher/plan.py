"""What a Spaces launch creates: the bucket and each Space's name, hardware, variables, secrets.

Pure functions of the configuration, the namespace and the Hub's hardware list, so a launch, its
re-run, its dry run and its teardown agree on every name.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltasync import settings

from .config import SpacesConfig
from .errors import LaunchError

__all__ = [
    "FLAVOR_OPTIONS",
    "MARKER_TAG",
    "PLACEHOLDER_NAMESPACE",
    "SDKS",
    "Hardware",
    "Plan",
    "SpaceSpec",
    "expected_host",
    "make_plan",
]

# Every Space launch.py creates carries this tag (front matter of its README); a Space of the
# same name without it belongs to someone else and is never updated or deleted.
MARKER_TAG = "deltasync"
TOKEN_SECRET = "HF_TOKEN"
# The Space SDK of each template (spaces/<kind>/README.md's front matter says the same).
SDKS = {"vllm": "docker", "wordle": "docker", "dashboard": "gradio"}
API_KEY_SECRET = settings.API_KEY.name
# The Wordle Space's key for /ws, /reset and /step (the same value as the replicas' key).
ENV_KEY_SECRET = "ENV_API_KEY"
# What a dry run without a login names things under (unless --namespace says).
PLACEHOLDER_NAMESPACE = "your-namespace"
# The launch.py option that sets each kind's hardware (named in errors).
FLAVOR_OPTIONS = {
    "vllm": "--vllm-flavor",
    "wordle": "--env-flavor",
    "dashboard": "--dashboard-flavor",
}


@dataclass(frozen=True)
class Hardware:
    """The Hub's Spaces hardware (`hf spaces hardware`): valid names, and those with a GPU.

    The CLI passes any `--flavor` name on (its choices are soft), and the Hub refuses an unknown one
    only after the Space exists; so names are checked against this list before anything is made.
    """

    names: tuple[str, ...]
    gpu: frozenset[str]

    @classmethod
    def from_cli(cls, rows: Any) -> Hardware:
        """From `hf spaces hardware --format json`: rows with `name` and `accelerator` (or null)."""
        if not isinstance(rows, list) or not all(
            isinstance(r, Mapping) and isinstance(r.get("name"), str) for r in rows
        ):
            raise LaunchError(
                "`hf spaces hardware --format json` did not list hardware by name; "
                "upgrade the CLI (pip install -U 'huggingface_hub>=2.4')"
            )
        names = tuple(r["name"] for r in rows)
        return cls(names, frozenset(r["name"] for r in rows if r.get("accelerator")))

    def check(self, option: str, name: str) -> None:
        """One-line error naming the valid hardware when `name` is not one of them."""
        if name in self.names:
            return
        close = difflib.get_close_matches(name, self.names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise LaunchError(
            f"{option} {name!r} is not Spaces hardware{hint}; valid: {', '.join(self.names)}"
        )


@dataclass(frozen=True)
class SpaceSpec:
    """One Space: `kind` names its template folder (spaces/<kind>/)."""

    role: str
    kind: str
    repo_id: str
    flavor: str
    private: bool
    variables: tuple[tuple[str, str], ...]
    secrets: tuple[str, ...]
    template_id: str | None = None
    sleep_time: int | None = None  # idle seconds before the Hub puts it to sleep; -1: never
    # secrets whose values go to the CLI on stdin (`--secrets-file -`), not from its environment
    piped: tuple[str, ...] = ()

    @property
    def sdk(self) -> str:
        return SDKS[self.kind]

    def create_args(self) -> list[str]:
        """Options shared by `hf repos create` and `hf repos duplicate`."""
        args = ["--type", "space", "--flavor", self.flavor, *self.sleep_args()]
        if self.private:
            args.append("--private")
        args += self.secret_args()
        for key, value in self.variables:
            args += ["-e", f"{key}={value}"]
        return args

    def secret_args(self) -> list[str]:
        """`-s KEY` (the CLI reads the value from its environment), then the piped ones."""
        args = [x for key in self.secrets for x in ("-s", key)]
        return args + (["--secrets-file", "-"] if self.piped else [])

    def sleep_args(self) -> list[str]:
        return [] if self.sleep_time is None else ["--sleep-time", str(self.sleep_time)]

    def hardware_args(self) -> list[str]:
        """`hf spaces settings` options that re-apply the hardware (and sleep time)."""
        return ["--hardware", self.flavor, *self.sleep_args()]


@dataclass(frozen=True)
class Plan:
    namespace: str
    bucket_id: str
    spaces: tuple[SpaceSpec, ...]

    @property
    def bucket_url(self) -> str:
        return f"hf://buckets/{self.bucket_id}"

    def replicas(self) -> tuple[SpaceSpec, ...]:
        return tuple(s for s in self.spaces if s.kind == "vllm")


def space_roles(replicas: int, env: str) -> list[tuple[str, str]]:
    """(role, kind) of every Space: the replicas, the Wordle env when used, the dashboard."""
    roles = [(f"vllm-{i}", "vllm") for i in range(replicas)]
    if env == "wordle":
        roles.append(("wordle", "wordle"))
    return [*roles, ("dashboard", "dashboard")]


def make_plan(cfg: SpacesConfig, namespace: str, gpu: frozenset[str] = frozenset()) -> Plan:
    """Every name and setting; replicas on hardware in `gpu` get `cfg.sleep_time_s`."""
    bucket_id = f"{namespace}/{cfg.bucket or cfg.name + '-weights'}"
    bucket_url = f"hf://buckets/{bucket_id}"
    # The replicas and the dashboard only read the bucket: with a read token (settings.READ_TOKEN)
    # their HF_TOKEN is piped in; without one the CLI gives them the token you are logged in with.
    token, piped = ((), (TOKEN_SECRET,)) if cfg.read_token else ((TOKEN_SECRET,), ())
    specs = []
    for role, kind in space_roles(cfg.replicas, cfg.env):
        # Replica i of a template owner is duplicated from their vllm-0.
        source = "vllm-0" if kind == "vllm" else role
        template = f"{cfg.from_template}/{cfg.name}-{source}" if cfg.from_template else None
        if kind == "vllm":
            variables = (("MODEL", cfg.model), ("BUCKET", bucket_url))
            variables += (("VLLM_ARGS", cfg.vllm_args),) if cfg.vllm_args else ()
            spec = SpaceSpec(
                role,
                kind,
                f"{namespace}/{cfg.name}-{role}",
                cfg.vllm_flavor,
                # Public on purpose: a private Space wants the HF token in the Authorization
                # header, which carries DELTASYNC_API_KEY here (every route but /health needs it).
                False,
                variables,
                (*token, API_KEY_SECRET),
                template,
                # a GPU bills by the minute: let it sleep once no trainer has used it for a while
                cfg.sleep_time_s if cfg.vllm_flavor in gpu else None,
                piped,
            )
        elif kind == "wordle":
            repo_id = f"{namespace}/{cfg.name}-{role}"
            secrets = (ENV_KEY_SECRET,)  # public, so only the trainer may play on it
            spec = SpaceSpec(role, kind, repo_id, cfg.env_flavor, False, (), secrets, template)
        else:
            # the dashboard shows every replica's version, lag and pause from its open /health
            hosts = [
                expected_host(f"{namespace}/{cfg.name}-{r}")
                for r, k in space_roles(cfg.replicas, cfg.env)
                if k == "vllm"
            ]
            spec = SpaceSpec(
                role,
                kind,
                f"{namespace}/{cfg.name}-{role}",
                cfg.dashboard_flavor,
                cfg.private,
                ((settings.BUCKET.name, bucket_url), (settings.REPLICAS.name, ",".join(hosts))),
                token,
                template,
                piped=piped,
            )
        specs.append(spec)
    return Plan(namespace, bucket_id, tuple(specs))


def expected_host(repo_id: str) -> str:
    """The Space's URL by the Hub's naming rule (used only when `spaces info` has no host)."""
    return "https://" + re.sub(r"[^a-z0-9-]", "-", repo_id.lower().replace("/", "-")) + ".hf.space"
