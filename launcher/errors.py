"""The launcher's errors: one root whose message is the one line the user reads, plus the fix."""

from __future__ import annotations

__all__ = [
    "HfCliMissing",
    "HfCommandError",
    "LaunchError",
    "NameTaken",
    "NotLoggedIn",
    "PaymentRequired",
    "ProcessFailed",
]

MIN_HF_VERSION = (2, 4)
INSTALL_HF = "pip install -U 'huggingface_hub>=2.4'"


class LaunchError(Exception):
    """Root of every error the launcher raises on purpose; `str()` is a complete message."""


class HfCliMissing(LaunchError):
    """The `hf` executable is not there, or it is older than the commands used here."""

    def __init__(self, found: str | None, where: str):
        what = f"hf CLI {found} at {where} is too old" if found else f"hf CLI not found ({where})"
        need = ".".join(map(str, MIN_HF_VERSION))
        super().__init__(f"{what}: launch.py needs hf >= {need}; install it with {INSTALL_HF}")
        self.found = found


class HfCommandError(LaunchError):
    """An `hf` call failed; keeps the command line and what the CLI printed."""

    def __init__(self, message: str, *, argv: tuple[str, ...] = (), stderr: str = ""):
        super().__init__(message)
        self.argv = argv
        self.stderr = stderr


class NotLoggedIn(HfCommandError):
    """`hf auth whoami` says no token is stored and HF_TOKEN is unset (or the token is invalid)."""


class HubUnreachable(HfCommandError):
    """The CLI could not reach the Hub (no network, DNS, a proxy); `reason` is its one line."""

    def __init__(self, message: str, *, reason: str, argv: tuple[str, ...] = (), stderr: str = ""):
        super().__init__(message, argv=argv, stderr=stderr)
        self.reason = reason


class PaymentRequired(HfCommandError):
    """The Hub answered 402: the hardware (or Docker Spaces) needs a payment method."""


class NameTaken(HfCommandError):
    """A Space of that name exists and was not made by launch.py, or the Hub refused the name."""


class ProcessFailed(LaunchError):
    """A local process exited early, or did not get healthy in time."""

    def __init__(self, message: str, *, name: str, returncode: int | None = None):
        super().__init__(message)
        self.name = name
        self.returncode = returncode
