"""The `hf` CLI (huggingface_hub >= 2.4) as a subprocess: echo, dry run, JSON answers, errors.

Every call is `hf <args> --format json` (the default format depends on environment variables,
not on a TTY). Secret values never appear on a command line: `-s KEY` makes the CLI read the
value from the environment this wrapper passes it. Failures become one-line `LaunchError`s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import (
    MIN_HF_VERSION,
    HfCliMissing,
    HfCommandError,
    HubUnreachable,
    NameTaken,
    NotLoggedIn,
    PaymentRequired,
)

__all__ = ["HfCli", "locate_hf"]

BILLING_URL = "https://huggingface.co/settings/billing"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TIMEOUT_S = 3600.0  # an upload of a build context is small; a hung CLI still ends


def locate_hf(explicit: str | None = None) -> str:
    """The `hf` executable: `--hf-cli`, else `hf` on PATH, else next to this Python."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise HfCliMissing(None, f"--hf-cli {explicit} is not an executable")
        return found
    found = shutil.which("hf")
    if found:
        return found
    sibling = Path(sys.executable).parent / "hf"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    raise HfCliMissing(None, "no `hf` on PATH")


class HfCli:
    """Runs `hf` commands; in a dry run, prints the ones that change something instead.

    Args:
        executable: path of `hf` (see `locate_hf`).
        dry_run: print changing commands without running them; queries still run.
        echo: where command lines (`$ hf ...`) and progress go.
        env: extra environment for every call (secret values the CLI reads by name).
    """

    def __init__(
        self,
        executable: str,
        *,
        dry_run: bool = False,
        echo: Callable[[str], None] = print,
        env: Mapping[str, str] | None = None,
    ):
        self.executable = executable
        self.dry_run = dry_run
        self.echo = echo
        self.env = {**os.environ, "HF_HUB_DISABLE_UPDATE_CHECK": "1", **(env or {})}

    def show(self, *args: str) -> None:
        """Print a command line the way every call does."""
        self.echo(f"  $ {shlex.join(['hf', *args])}")

    def check_version(self) -> str:
        """The CLI's version; raises `HfCliMissing` when it is older than 2.4 or unreadable."""
        argv = ("version", "--format", "json")
        self.show(*argv)
        proc = self._run(argv)
        try:
            version = str(json.loads(proc.stdout)["version"])
        except (ValueError, KeyError, TypeError):
            version = None
        if proc.returncode != 0 or version is None or _parse_version(version) < MIN_HF_VERSION:
            raise HfCliMissing(version or "(unknown version)", self.executable)
        return version

    def query(self, *args: str, quiet: bool = False) -> Any:
        """A read-only command (runs in a dry run too); its `--format json` answer."""
        if not quiet:
            self.show(*args, "--format", "json")
        return self._json(args)

    def query_optional(self, *args: str, quiet: bool = False) -> Any | None:
        """Like `query`, but None when the CLI says the thing does not exist."""
        try:
            return self.query(*args, quiet=quiet)
        except HfCommandError as exc:
            if "not found" in exc.stderr.lower():
                return None
            raise

    def change(self, *args: str, stdin: str | None = None) -> Any:
        """A command that changes something on the Hub; only printed in a dry run.

        `stdin` goes to the CLI's standard input (`--secrets-file -`), never onto the command line.
        """
        self.show(*args, "--format", "json")
        if self.dry_run:
            return None
        return self._json(args, stdin)

    def text(self, *args: str) -> list[str]:
        """A read-only command whose output is text lines (`hf spaces logs`)."""
        full = (*args, "--format", "agent")
        self.show(*full)
        proc = self._run(full)
        if proc.returncode != 0:
            raise _explain(full, proc.stderr)
        return proc.stdout.splitlines()

    def _json(self, args: tuple[str, ...], stdin: str | None = None) -> Any:
        full = (*args, "--format", "json")
        proc = self._run(full, stdin)
        if proc.returncode != 0:
            raise _explain(full, proc.stderr)
        out = proc.stdout.strip()
        if not out:
            return {}
        try:
            return json.loads(out)
        except ValueError:
            pass
        try:
            return json.loads(out.splitlines()[-1])
        except ValueError:
            raise HfCommandError(
                f"`{shlex.join(['hf', *full])}` printed no JSON: {out[:200]!r}",
                argv=full,
                stderr=proc.stderr,
            ) from None

    def _run(
        self, args: tuple[str, ...], stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.executable, *args],
                capture_output=True,
                text=True,
                env=self.env,
                input=stdin if stdin is not None else "",
                timeout=_TIMEOUT_S,
            )
        except OSError as exc:
            raise HfCliMissing(None, f"{self.executable} does not run: {exc.strerror}") from None
        except subprocess.TimeoutExpired:
            raise HfCommandError(
                f"`{shlex.join(['hf', *args])}` did not finish in {_TIMEOUT_S:.0f}s", argv=args
            ) from None


def _parse_version(text: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", text)[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 else (0, 0)


def _error_line(stderr: str) -> str:
    """The CLI's `Error: ...` message (hints and warnings dropped), joined on one line."""
    lines = [_ANSI.sub("", line).strip() for line in stderr.splitlines()]
    lines = [x for x in lines if x and not x.startswith(("Hint:", "Warning:"))]
    for i, line in enumerate(lines):
        if line.startswith("Error:"):
            return " ".join([line.removeprefix("Error:").strip(), *lines[i + 1 : i + 3]])
    return " ".join(lines[-3:]) or "no error message"


# How an unreachable Hub shows in the CLI's traceback (httpx's ConnectError, DNS, a proxy).
_UNREACHABLE = re.compile(
    r"^\S*(ConnectError|ConnectTimeout|ProxyError|ConnectionError|NameResolutionError)"
    r": (?P<reason>.+)$",
    re.M,
)


def _explain(argv: tuple[str, ...], stderr: str) -> HfCommandError:
    """Turn a failed call into the error the user can act on."""
    message = _error_line(stderr)
    command = shlex.join(["hf", *argv])
    low = _ANSI.sub("", stderr).lower()
    target = next((a for a in argv[2:] if "/" in a and not a.startswith(("-", "/"))), "")
    if found := list(_UNREACHABLE.finditer(_ANSI.sub("", stderr))):
        reason = found[-1].group("reason").strip()[:200]
        return HubUnreachable(
            f"`{command}` could not reach the Hub ({reason}): check the network or a proxy "
            "(HTTPS_PROXY) and re-run",
            reason=reason,
            argv=argv,
            stderr=stderr,
        )
    if "not logged in" in low or _status(low, 401, "unauthorized", "invalid credentials"):
        return NotLoggedIn(
            "not logged in to the Hugging Face Hub: run `hf auth login` (or set HF_TOKEN) "
            "and re-run",
            argv=argv,
            stderr=stderr,
        )
    if _status(low, 402, "payment required"):
        flavor = _option(argv, "--flavor") or _option(argv, "--hardware")
        what = f"hardware {flavor!r} for {target}" if flavor else target or "this request"
        return PaymentRequired(
            f"payment required for {what}: add a payment method at {BILLING_URL} or choose "
            "free hardware (--vllm-flavor/--env-flavor/--dashboard-flavor cpu-basic)",
            argv=argv,
            stderr=stderr,
        )
    if _status(low, 409, "conflict", "already exists", "already created"):
        return NameTaken(
            f"the name {target or '?'} is taken ({message}); pass another --name or --bucket",
            argv=argv,
            stderr=stderr,
        )
    if _status(low, 403, "forbidden"):
        return HfCommandError(
            f"no permission for `{command}` ({message}): the token needs write access to the "
            "namespace (see `hf auth whoami`, or pass --namespace)",
            argv=argv,
            stderr=stderr,
        )
    return HfCommandError(f"`{command}` failed: {message}", argv=argv, stderr=stderr)


def _status(text: str, code: int, *phrases: str) -> bool:
    """The HTTP status appears as a number of its own (not inside an id) or by its phrase."""
    return bool(re.search(rf"(?<![\w-]){code}(?![\w-])", text)) or any(p in text for p in phrases)


def _option(argv: tuple[str, ...], name: str) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg == name:
            return argv[i + 1]
    return None
