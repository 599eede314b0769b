"""`launch.py --local`: every part as a process on this machine, a folder as the bucket.

Order: the Wordle server (with `--env wordle`) and the dashboard start first, a random Qwen3
(`small`, `tiny`) is built offline, then the vLLM replicas start and catch up with the bucket;
once every process is healthy the trainer runs its bounded number of steps. When it ends (or
anything fails, or Ctrl-C) every process is stopped and a summary says where the bucket and the
dashboard are and how the rollouts were spread over the replicas.

Cores: with two or more replicas each engine gets its own cores (`core_binds`): left to vLLM's
own `VLLM_CPU_OMP_THREADS_BIND=auto`, every engine binds the same first cores, so they slow each
other down, and one of them generates far slower than the other. The dashboard is told the
replicas' URLs (`DELTASYNC_REPLICAS`, as on Spaces) for its lag view: their `/health` is open.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deltasync import settings
from deltasync.defaults import ENCODING
from deltasync.wire.metrics import SyncRecord
from trainer.defaults import BUILT
from trainer.envs.report import load_warnings
from trainer.routing import read_completions

from .commands import (
    class_path_env,
    dashboard_command,
    prepare_command,
    replica_command,
    shown,
    trainer_command,
    verify_command,
    warm_up_command,
    wordle_command,
)
from .config import LocalConfig, env_kind
from .errors import LaunchError, ProcessFailed
from .staging import REPO_ROOT
from .supervisor import Child, ProcessSpec, Supervisor

__all__ = [
    "LocalPlan",
    "build_model",
    "check_ports",
    "core_binds",
    "local_plan",
    "run_local",
    "summarize",
]

# Wordle's prompt with its tool schema is ~1300 tokens for a built model's byte-level tokenizer,
# an MCP server's four tools ~1500, and every turn adds its call and the reply: the built model's
# whole context (trainer.random_qwen3: max_position_embeddings).
TOOL_CONTEXT = 4096
_TINY_VLLM_ARGS = "--max-model-len 512 --max-num-seqs 16 --disable-log-stats"
_VLLM_ARGS = f"--max-model-len {TOOL_CONTEXT} --max-num-seqs 16 --disable-log-stats"
_PREPARE_TIMEOUT_S = 600.0
LATEST = "latest"  # <workdir>/latest -> the last run's folder
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class LocalPlan:
    """The processes of a local run, in start order (services, then the trainer)."""

    prepare: ProcessSpec | None
    warm_up: ProcessSpec  # compiles the codec's loops while the replicas start
    services: tuple[ProcessSpec, ...]
    trainer: ProcessSpec
    bucket: Path
    run_dir: Path
    dashboard_url: str
    api_key: str
    replica_urls: Mapping[str, str]  # vllm-i -> its base URL
    warnings: tuple[str, ...] = ()  # said before anything starts


def core_binds(replicas: int, cores: Sequence[int]) -> tuple[list[str | None], str | None]:
    """Each replica's `VLLM_CPU_OMP_THREADS_BIND` (None: vLLM's own `auto`), and a warning.

    One replica keeps `auto`: vLLM binds its threads to all cores but the last, which it leaves
    to its scheduler process. Two or more split the cores evenly in contiguous shares; a share of
    two or more cores keeps its last one out of the OpenMP threads for that engine's scheduler,
    as `auto` does. With fewer cores than replicas the engines share cores round-robin, one
    core each, and the warning says so. The trainer is not pinned: its threads go where the
    OS puts them, on every core; on CPU it mostly trains while the engines wait for the next
    batch (generation outpaces training), and a share of its own would sit idle meanwhile.
    """
    if replicas < 2:
        return [None] * replicas, None
    if len(cores) < replicas:
        binds = [str(cores[i % len(cores)]) for i in range(replicas)]
        shared = ", ".join(f"vllm-{i}: {b}" for i, b in enumerate(binds))
        return binds, (
            f"{replicas} replicas on {len(cores)} cores: engines share cores round-robin "
            f"(core of {shared}), so each generates slower than it would alone"
        )
    shares = [
        cores[i * len(cores) // replicas : (i + 1) * len(cores) // replicas]
        for i in range(replicas)
    ]
    return [",".join(map(str, s[:-1] if len(s) > 1 else s)) for s in shares], None


def local_plan(cfg: LocalConfig, cores: Sequence[int] | None = None) -> LocalPlan:
    """Command lines, environments and health checks of every process (pure; no side effect).

    `cores`: the CPUs the replicas may use (default: this process's affinity). A binding set
    in the environment (`VLLM_CPU_OMP_THREADS_BIND`) is left to every replica as it is.
    """
    kind = env_kind(cfg.env)
    run_dir = cfg.run_dir.resolve()
    bucket = cfg.bucket_dir.resolve()
    model_dir = cfg.model_dir.resolve()
    built = cfg.model in BUILT  # a random Qwen3 built offline
    served = str(model_dir) if built else cfg.model  # the replicas serve the trainer's string
    key = cfg.api_key or secrets.token_urlsafe(24)
    short = built and kind == "sanity"
    vllm_args = shlex.split(cfg.vllm_args or (_TINY_VLLM_ARGS if short else _VLLM_ARGS))
    services = []
    env_url = None
    if kind == "wordle":
        env_url = f"http://127.0.0.1:{cfg.env_port}"
        services.append(
            ProcessSpec(
                "wordle",
                tuple(wordle_command(cfg.env_port)),
                ready_url=f"{env_url}/health",
                stop_grace_s=10,
            )
        )
    elif kind == "openenv":
        env_url = cfg.env
    ports = {f"vllm-{i}": cfg.vllm_port + 10 * i for i in range(cfg.replicas)}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    dashboard_url = f"http://127.0.0.1:{cfg.dashboard_port}"
    services.append(
        ProcessSpec(
            "dashboard",
            tuple(dashboard_command(str(bucket), cfg.dashboard_port)),
            env={
                "GRADIO_ANALYTICS_ENABLED": "False",
                settings.REPLICAS.name: ",".join(urls.values()),
            },
            ready_url=dashboard_url + "/",
            stop_grace_s=10,
        )
    )
    binds, warning = [None] * cfg.replicas, None
    if BIND_ENV not in os.environ:
        binds, warning = core_binds(cfg.replicas, cores or sorted(os.sched_getaffinity(0)))
    for (name, port), bind in zip(ports.items(), binds, strict=True):
        services.append(
            ProcessSpec(
                name,
                tuple(replica_command(served, str(bucket), port, vllm_args)),
                env={settings.API_KEY.name: key, **({BIND_ENV: bind} if bind else {})},
                ready_line="ready on ",
                health_url=f"{urls[name]}/health",  # 503 once its engine died, though it runs
                # serve.py gives vLLM 20 s to stop its own process tree; give it that and more.
                stop_grace_s=45,
            )
        )
    trainer = ProcessSpec(
        "trainer",
        tuple(
            trainer_command(
                model=cfg.model,
                model_dir=model_dir if built else None,
                bucket=str(bucket),
                urls=list(urls.values()),
                env=kind,
                env_url=env_url,
                steps=cfg.steps,
                run_id=cfg.run_name,
                output_dir=run_dir / "trainer",
                seed=cfg.seed,
                verify=True,
                extra=(
                    "--log-file",
                    str(run_dir / "logs" / "trainer.log"),
                    *(["--verbose"] if cfg.verbose else []),
                    *cfg.trainer_args,
                ),
            )
        ),
        console=True,
        env={
            settings.API_KEY.name: key,
            "TRL_EXPERIMENTAL_SILENCE": "1",
            **class_path_env(kind),
        },
        stop_grace_s=20,
    )
    prepare = None
    if built:
        prepare = ProcessSpec(
            "prepare",
            tuple(prepare_command(cfg.model, model_dir, cfg.seed)),
            env={"TRL_EXPERIMENTAL_SILENCE": "1"},
        )
    warm_up = ProcessSpec("warm-up", tuple(warm_up_command(_encoding(cfg.trainer_args))))
    return LocalPlan(
        prepare,
        warm_up,
        tuple(services),
        trainer,
        bucket,
        run_dir,
        dashboard_url,
        key,
        urls,
        (warning,) if warning else (),
    )


def run_local(cfg: LocalConfig, echo: Callable[[str], None] = print) -> int:
    """Run everything; returns the trainer's exit status (0: every sync done and verified)."""
    plan = local_plan(cfg)
    for warning in plan.warnings:
        echo(f"warning: {warning}")
    if cfg.dry_run:
        echo(f"would run (bucket {plan.bucket}, logs {plan.run_dir / 'logs'}):")
        prepare = [plan.prepare] if plan.prepare else []
        for spec in (*prepare, plan.warm_up, *plan.services, plan.trainer):
            echo(f"  $ {shown(spec.argv)}")
        return 0
    check_ports(cfg)
    plan.bucket.mkdir(parents=True, exist_ok=True)
    mark_latest(plan.run_dir)
    started = time.monotonic()
    with Supervisor(log_dir=plan.run_dir / "logs", cwd=REPO_ROOT, verbose=cfg.verbose) as sup:
        sup.say(f"logs {plan.run_dir / 'logs'} (every process's whole output)")
        names = ", ".join(s.name for s in plan.services)
        sup.say(f"starting {names} and compiling the codec's loops (a minute or two)")
        early = [sup.start(s) for s in plan.services if not s.name.startswith("vllm-")]
        build_model(sup, plan, cfg)
        replicas = [sup.start(s) for s in plan.services if s.name.startswith("vllm-")]
        warm_up = sup.start(plan.warm_up)
        sup.wait_ready([*early, *replicas], cfg.startup_timeout_s)
        finish_warm_up(sup, warm_up)
        sup.say(
            f"all healthy in {time.monotonic() - started:.0f} s; dashboard at "
            f"{plan.dashboard_url}; training {cfg.steps} steps"
        )
        code = sup.wait_exit(sup.start(plan.trainer))
    for line in summarize(plan, cfg, time.monotonic() - started, code):
        echo(line)
    return code


def build_model(sup: Supervisor, plan: LocalPlan, cfg: LocalConfig) -> None:
    """Build the random model (when the run uses one) before any replica loads it, and check
    that a tool environment's prompts fit its context."""
    if plan.prepare is None:
        return
    prep = sup.start(plan.prepare)
    if sup.wait_exit(prep, _PREPARE_TIMEOUT_S) != 0:
        raise ProcessFailed(f"building the model failed:\n{prep.last_lines()}", name="prepare")
    if env_kind(cfg.env) != "sanity" and cfg.vllm_args is None:
        _check_context(cfg.model_dir.resolve())


def mark_latest(run_dir: Path) -> None:
    """`<workdir>/latest` names this run's folder, so the last run's bucket and logs have one
    path (`out/local/latest/bucket`, README's examples)."""
    if run_dir.name == LATEST:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    link, staged = run_dir.parent / LATEST, run_dir.parent / f".{LATEST}-{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(run_dir.name)
    try:
        os.replace(staged, link)
    except OSError:  # a real folder of that name (a run called latest): leave it be
        staged.unlink(missing_ok=True)


def finish_warm_up(sup: Supervisor, warm_up: Child) -> None:
    """Wait for the codec's loops to be compiled (usually done while the replicas started), so
    that compiling them does not hold up the first versions."""
    if sup.wait_exit(warm_up, _PREPARE_TIMEOUT_S) != 0:
        raise ProcessFailed(
            f"compiling the codec's loops failed:\n{warm_up.last_lines()}", name="warm-up"
        )


def _encoding(trainer_args: Sequence[str]) -> str:
    """The trainer's `--encoding` when the run passes one, else the default."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--encoding", default=ENCODING)
    return parser.parse_known_args(list(trainer_args))[0].encoding


def summarize(plan: LocalPlan, cfg: LocalConfig, elapsed_s: float, code: int) -> list[str]:
    """What happened, read back from the bucket's metrics records, and where things are."""
    records = []
    for path in sorted((plan.bucket / "runs" / cfg.run_name / "metrics").glob("*.json")):
        try:
            records.append(SyncRecord.from_json(path.read_bytes(), path=str(path)))
        except (OSError, ValueError):  # FormatError is a ValueError
            continue
    status = "done" if code == 0 else f"trainer failed (status {code})"
    view = shown(dashboard_command(str(plan.bucket), cfg.dashboard_port))
    return [
        f"{status} in {elapsed_s / 60:.1f} min: run {cfg.run_name}, {len(records)} versions "
        f"published",
        *(f"{name}: {counts}" for name, counts in replica_outcomes(records).items()),
        f"bucket:    {plan.bucket}   ({shown(verify_command(str(plan.bucket)))})",
        f"dashboard: was {plan.dashboard_url}; view it again with: {view}",
        *_rollouts(plan),
        f"logs:      {plan.run_dir / 'logs'}",
        *(f"warning: {w}" for w in load_warnings(plan.run_dir / "trainer", cfg.run_name)),
    ]


def replica_outcomes(records: Sequence[SyncRecord]) -> dict[str, str]:
    """Per replica, what became of the versions: applied (and verified against what its engine
    serves), superseded (it went straight to a newer one: nothing applied), failed."""
    counts: dict[str, list[int]] = {}
    for record in records:
        for outcome in record.replicas:
            applied, superseded, failed = counts.setdefault(outcome.name, [0, 0, 0])
            if not outcome.ok:
                failed += 1
            elif outcome.superseded(record.version):
                superseded += 1
            else:
                applied += 1
            counts[outcome.name] = [applied, superseded, failed]
    return {
        name: f"{applied} versions applied and verified, {superseded} superseded, {failed} failed"
        for name, (applied, superseded, failed) in sorted(counts.items())
    }


def _rollouts(plan: LocalPlan) -> list[str]:
    """Completions per replica, from the proxy's last line in trainer.log; none if it has none."""
    try:
        text = (plan.run_dir / "logs" / "trainer.log").read_text(errors="replace")
    except OSError:
        return []
    done = read_completions(text)
    if done is None:
        return []
    counts = {name: done.get(url, 0) for name, url in plan.replica_urls.items()}
    mean = sum(counts.values()) / len(counts)
    each = ", ".join(f"{name} {n}" for name, n in counts.items())
    busiest = max(counts.values()) / mean if mean and len(counts) > 1 else None
    spread = f"; busiest {busiest:.2f}x the mean" if busiest else ""
    return [f"rollouts:  {each} completions{spread}"]


def _check_context(model_dir: Path) -> None:
    """Fail now, not after minutes of rejected requests, when tool prompts cannot fit."""
    config = json.loads((model_dir / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or 0)
    if context < TOOL_CONTEXT:
        raise LaunchError(
            f"the built model's context ({context} tokens) is shorter than a Wordle/OpenEnv "
            f"prompt with its tool (~1300 tokens, {TOOL_CONTEXT} needed): use --env sanity, or "
            "a real model (--model Qwen/Qwen3-0.6B, where the Hub is reachable)"
        )


def check_ports(cfg: LocalConfig) -> None:
    ports = {"--dashboard-port": cfg.dashboard_port}
    if env_kind(cfg.env) == "wordle":
        ports["--env-port"] = cfg.env_port
    for i in range(cfg.replicas):
        ports[f"--vllm-port (replica {i})"] = cfg.vllm_port + 10 * i
    for option, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise LaunchError(
                    f"port {port} on 127.0.0.1 is in use: stop what listens there or pass "
                    f"{option.split()[0]} PORT"
                ) from None
