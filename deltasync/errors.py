"""The error types of the protocol: one root, a few precise subclasses that keep their fields."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ChainError",
    "DeltaSyncError",
    "DigestMismatch",
    "ExportError",
    "FormatError",
    "MissingExtra",
    "PublishError",
    "ReloadError",
    "StoreError",
    "import_tensor_side",
]


class DeltaSyncError(Exception):
    """Root of every error this library raises on purpose."""


class FormatError(DeltaSyncError, ValueError):
    """A file or manifest is malformed, truncated, oversized or names unknown tensors.

    Raised before anything is mutated, so the caller's state is unchanged.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        where = (f" in {path}" if path else "") + (f" (tensor {tensor!r})" if tensor else "")
        super().__init__(f"{message}{where}")
        self.path = path
        self.tensor = tensor


class ChainError(DeltaSyncError):
    """A delta does not follow the version the reader holds (other run or other base version)."""

    def __init__(self, message: str, *, expected: object = None, found: object = None):
        super().__init__(message)
        self.expected = expected
        self.found = found


class DigestMismatch(DeltaSyncError):
    """The bytes after an update do not hash to the digest the file promised, or held bytes
    changed without an update (`tensor` names it; empty for the whole state)."""

    def __init__(
        self,
        tensor: str,
        expected: str,
        found: str,
        *,
        path: str | None = None,
        message: str | None = None,
    ):
        super().__init__(
            message
            or f"digest mismatch for tensor {tensor!r}{f' from {path}' if path else ''}: "
            f"expected {expected}, found {found}; nothing was applied"
        )
        self.tensor = tensor
        self.expected = expected
        self.found = found
        self.path = path


class ReloadError(DeltaSyncError):
    """The serving engine did not take a version's weights as they are (a module's loaders got
    fewer elements than it loads): the previous version is restored and keeps serving."""


class StoreError(DeltaSyncError):
    """A bucket operation failed (after retries, where the caller retries)."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(f"{message}{f' ({path})' if path else ''}")
        self.path = path


class PublishError(DeltaSyncError):
    """A background publish gave up; the version it carried was not committed."""

    def __init__(self, message: str, *, version: int | None = None):
        super().__init__(message)
        self.version = version


class Fenced(PublishError):
    """Another publisher took the run over (or replaced it) in the bucket: this one may never
    commit again; restart it with `takeover` to continue from the bucket."""


class ExportError(DeltaSyncError):
    """An export cannot be done as asked; nothing was written."""


class MissingExtra(ImportError):
    """The tensor side was asked for where only the torch-free core is installed."""


def import_tensor_side(module: str) -> Any:
    """Import a module of the tensor side, naming the extra to install when torch & co. lack."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in {"torch", "numpy", "numba", "safetensors", "zstandard"}:
            raise MissingExtra(
                f"{module} needs {missing}: pip install 'deltasync[torch]' ({exc})", name=exc.name
            ) from exc
        raise
