"""What a Spaces launch creates: the bucket and each Space's name, hardware, variables, secrets.

Pure functions of the configuration and the namespace, so a launch, its re-run, its dry run and
its teardown agree on every name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import SpacesConfig

__all__ = ["MARKER_TAG", "SDKS", "Plan", "SpaceSpec", "expected_host", "make_plan", "space_roles"]

# Every Space launch.py creates carries this tag (front matter of its README); a Space of the
# same name without it belongs to someone else and is never updated or deleted.
MARKER_TAG = "deltasync"
TOKEN_SECRET = "HF_TOKEN"
# The Space SDK of each template (spaces/<kind>/README.md's front matter says the same).
SDKS = {"vllm": "docker", "wordle": "docker", "dashboard": "gradio"}
API_KEY_SECRET = "DELTASYNC_API_KEY"


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

    @property
    def sdk(self) -> str:
        return SDKS[self.kind]

    def create_args(self) -> list[str]:
        """Options shared by `hf repos create` and `hf repos duplicate`."""
        args = ["--type", "space", "--flavor", self.flavor]
        if self.private:
            args.append("--private")
        for key in self.secrets:
            args += ["-s", key]
        for key, value in self.variables:
            args += ["-e", f"{key}={value}"]
        return args


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

    def env_space(self) -> SpaceSpec | None:
        return next((s for s in self.spaces if s.kind == "wordle"), None)


def space_roles(replicas: int, env: str) -> list[tuple[str, str]]:
    """(role, kind) of every Space: the replicas, the Wordle env when used, the dashboard."""
    roles = [(f"vllm-{i}", "vllm") for i in range(replicas)]
    if env == "wordle":
        roles.append(("wordle", "wordle"))
    return [*roles, ("dashboard", "dashboard")]


def make_plan(cfg: SpacesConfig, namespace: str) -> Plan:
    bucket_id = f"{namespace}/{cfg.bucket or cfg.name + '-weights'}"
    bucket_url = f"hf://buckets/{bucket_id}"
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
                (TOKEN_SECRET, API_KEY_SECRET),
                template,
            )
        elif kind == "wordle":
            repo_id = f"{namespace}/{cfg.name}-{role}"
            spec = SpaceSpec(role, kind, repo_id, cfg.env_flavor, False, (), (), template)
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
                (("DELTASYNC_BUCKET", bucket_url), ("DELTASYNC_REPLICAS", ",".join(hosts))),
                (TOKEN_SECRET,),
                template,
            )
        specs.append(spec)
    return Plan(namespace, bucket_id, tuple(specs))


def expected_host(repo_id: str) -> str:
    """The Space's URL by the Hub's naming rule (used only when `spaces info` has no host)."""
    return "https://" + re.sub(r"[^a-z0-9-]", "-", repo_id.lower().replace("/", "-")) + ".hf.space"
