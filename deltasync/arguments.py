"""Argument types the command-line entry points share (the benchmarks, the trainer, the replica
server): a mistyped number, folder, port or URL ends in argparse's one-line `error:`
(exit status 2) before any model is built, never in a traceback halfway through a run.
Torch-free (`torch_device` imports it when called)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "bucket_url",
    "count",
    "existing_folder",
    "folder",
    "fraction",
    "http_url",
    "is_loopback",
    "json_path",
    "learning_rate",
    "model_ref",
    "non_negative",
    "port",
    "positive",
    "rate",
    "scratch",
    "torch_device",
    "whole",
    "zstd_level",
]


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bounded(kind: type, ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` for which `ok` holds, else "expected ..."."""

    def parse(text: str) -> Any:
        value = kind(_number(text, kind))
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


# steps, versions, replicas, repeats, ranks
count = _bounded(int, lambda v: v >= 1, "an integer >= 1")
# how many faults to inject
whole = _bounded(int, lambda v: v >= 0, "an integer >= 0")
# a TCP port a server can listen on
port = _bounded(int, lambda v: 1 <= v <= 65535, "a port in 1..65535")
zstd_level = _bounded(int, lambda v: 1 <= v <= 22, "a zstd level in 1..22")
# timeouts, intervals
positive = _bounded(float, lambda v: v > 0, "a number > 0")
# delays
non_negative = _bounded(float, lambda v: v >= 0, "a number >= 0")
# a share strictly between 0 and 1 (densities)
fraction = _bounded(float, lambda v: 0 < v < 1, "a number in (0, 1)")
# a probability in [0, 1) (fault rates: 1 would never let an operation through)
rate = _bounded(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
learning_rate = _bounded(float, lambda v: 0 < v < 1, "a learning rate in (0, 1)")


def torch_device(text: str) -> str:
    """A torch device this machine has (cpu, cuda, cuda:1)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a torch device (cpu, cuda), got {text!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("no CUDA device here: pass --device cpu to run on the CPU")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return text


def _creatable(path: Path, text: str) -> None:
    """A folder can be made at `path`: no part of it is a file."""
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                where = "" if part == path else f": {part}"
                raise argparse.ArgumentTypeError(f"{text}{where} is a file, not a folder")
            return


def folder(text: str) -> str:
    """A folder to use, created when missing (work folders, caches)."""
    _creatable(Path(text).expanduser(), text)
    return text


def existing_folder(text: str) -> str:
    """A folder that must exist already (one to read from)."""
    if not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"no folder {text}")
    return text


def json_path(text: str) -> str:
    """Where to write a JSON result (its folder is created when missing)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    _creatable(path.parent, text)
    return text


def http_url(text: str) -> str:
    """An http(s) URL naming a host (a server to use instead of starting one)."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT], got {text!r}")
    return text.rstrip("/")


def is_loopback(host: str) -> bool:
    """`host` (an address or `localhost`) reaches only this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bucket_url(text: str) -> str:
    """A folder or a URL whose protocol fsspec knows (`hf://buckets/NS/NAME`, `s3://...`),
    checked without connecting or creating anything."""
    if "://" not in text:
        return folder(text)
    import fsspec

    protocol = text.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise argparse.ArgumentTypeError(
            f"cannot use {text!r}: {str(exc).splitlines()[0]}; use a folder, "
            "hf://buckets/NS/NAME, s3://, gs:// or another fsspec protocol"
        ) from None
    return text


def model_ref(text: str) -> str:
    """A Hub model id or a model folder; a path (it starts with /, ., ~) must exist."""
    if text.startswith(("/", ".", "~")) and not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"no model folder {text}")
    return text


def scratch(parent: str | None, prefix: str) -> Path:
    """A fresh temporary folder, inside `parent` (created when missing) if given."""
    where = None if parent is None else Path(parent).expanduser()
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=where))
