"""Wait until Spaces run: one line per stage change, a heartbeat, build logs on failure."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import HfCommandError, LaunchError
from .hf import HfCli
from .plan import SpaceSpec, expected_host

__all__ = ["space_url", "stage_of", "wait_running"]

FAILED = ("BUILD_ERROR", "RUNTIME_ERROR", "CONFIG_ERROR", "NO_APP_FILE")
ASLEEP = ("PAUSED", "SLEEPING", "STOPPED")
# Right after an upload the Hub may still report the previous commit's stage for a moment;
# without a runtime sha to tell, a failure stage counts only after this long.
_STALE_GRACE_S = 90.0
_HEARTBEAT_S = 60.0
_LOG_LINES = 30


def stage_of(info: dict[str, Any]) -> str:
    """The runtime stage; `UPDATING` while the runtime still runs an older commit."""
    runtime = info.get("runtime") or {}
    stage = str(runtime.get("stage") or "UNKNOWN")
    running_sha = (runtime.get("raw") or {}).get("sha")
    if running_sha and info.get("sha") and running_sha != info["sha"]:
        return "UPDATING"
    return stage


def space_url(info: dict[str, Any], repo_id: str) -> str:
    host = info.get("host") or (
        f"https://{info['subdomain']}.hf.space" if info.get("subdomain") else None
    )
    if not host:
        return expected_host(repo_id)
    return host if host.startswith("http") else f"https://{host}"


def wait_running(
    hf: HfCli,
    specs: Sequence[SpaceSpec],
    *,
    timeout_s: float,
    poll_s: float,
    echo: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Poll `hf spaces info` until every Space is RUNNING; returns role -> URL.

    In a dry run, prints the poll once per Space and returns the URLs the Hub would assign.
    """
    if hf.dry_run:
        for spec in specs:
            hf.show("spaces", "info", spec.repo_id, "--format", "json")
        echo("  (would wait until each Space is RUNNING)")
        return {spec.role: expected_host(spec.repo_id) for spec in specs}
    width = max(len(s.repo_id) for s in specs)
    echo(f"waiting for {len(specs)} Space(s) to build and start (timeout {_fmt(timeout_s)}):")
    start = clock()
    last_beat = start
    stages: dict[str, str] = {}
    restarted: set[str] = set()
    urls: dict[str, str] = {}
    pending = list(specs)
    while True:
        for spec in list(pending):
            info = hf.query("spaces", "info", spec.repo_id, quiet=True)
            stage = stage_of(info)
            elapsed = clock() - start
            if stages.get(spec.repo_id) != stage:
                echo(f"  {spec.repo_id:<{width}}  {stage:<14} {_fmt(elapsed)}")
                stages[spec.repo_id] = stage
            if stage == "RUNNING":
                urls[spec.role] = space_url(info, spec.repo_id)
                pending.remove(spec)
            elif stage in FAILED and (_sha_known(info) or elapsed >= _STALE_GRACE_S):
                _fail(hf, spec, stage, echo)
            elif stage in ASLEEP and spec.repo_id not in restarted:
                hf.change("spaces", "restart", spec.repo_id)
                restarted.add(spec.repo_id)
        if not pending:
            return urls
        now = clock()
        if now - start > timeout_s:
            waiting = ", ".join(f"{s.repo_id} ({stages.get(s.repo_id)})" for s in pending)
            raise LaunchError(
                f"timed out after {_fmt(timeout_s)} waiting for {waiting}; see "
                f"`hf spaces logs {pending[0].repo_id} --build`, then re-run (or --wait-timeout)"
            )
        if now - last_beat >= _HEARTBEAT_S:
            echo("  still waiting: " + ", ".join(f"{s.role} {stages[s.repo_id]}" for s in pending))
            last_beat = now
        sleep(poll_s)


def _sha_known(info: dict[str, Any]) -> bool:
    return bool(((info.get("runtime") or {}).get("raw") or {}).get("sha"))


def _fail(hf: HfCli, spec: SpaceSpec, stage: str, echo: Callable[[str], None]) -> None:
    build = stage in ("BUILD_ERROR", "CONFIG_ERROR", "NO_APP_FILE")
    args = ["spaces", "logs", spec.repo_id, *(["--build"] if build else []), "-n", str(_LOG_LINES)]
    try:
        lines = hf.text(*args)
    except HfCommandError as exc:
        lines = [f"(no logs: {exc})"]
    kind = "build" if build else "run"
    echo(f"last {kind} log lines of {spec.repo_id}:")
    for line in lines[-_LOG_LINES:]:
        echo(f"  | {line}")
    raise LaunchError(
        f"{spec.repo_id} is in {stage} (its {kind} log is above; "
        f"https://huggingface.co/spaces/{spec.repo_id}); fix it and re-run launch.py"
    )


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
