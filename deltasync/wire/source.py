"""Where a virtual anchor's weights live: a checkpoint every replica can read on its own.

A run's first version usually equals the checkpoint the trainer started from, byte for byte
(bf16 view). Then version 1 need not carry the weights: a *virtual anchor* names the checkpoint -
a Hub model repository pinned to a commit, or a local folder - and the per-tensor digests, and a
replica loads the tensors from there (`deltasync.codec.virtual`) and verifies every one of them
(bucket_layout.md). This is the record, torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from deltasync.errors import FormatError

__all__ = ["ModelSource", "resolve_source"]

_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
_SHA = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint: `kind` "hub" (`location` a repo id, `revision` a 40-hex commit) or
    "folder" (`location` an absolute path on the reader's machine, `revision` None)."""

    kind: str
    location: str
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hub":
            if not (_REPO.fullmatch(self.location) and _SHA.fullmatch(self.revision or "")):
                raise FormatError(
                    f"a hub source needs a repo id and a 40-hex commit, got {self.location!r} "
                    f"at {self.revision!r}"
                )
        elif self.kind == "folder":
            if (
                not self.location.startswith("/")
                or "\0" in self.location
                or self.revision is not None
            ):
                raise FormatError(f"a folder source needs an absolute path, got {self.location!r}")
        else:
            raise FormatError(f"unknown model source kind {self.kind!r} (hub or folder)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))  # kind, location, revision

    @classmethod
    def from_json(cls, text: str | None) -> ModelSource:
        try:
            raw = json.loads(text or "")
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"metadata 'source' is not JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) != {"kind", "location", "revision"}:
            raise FormatError("metadata 'source' needs exactly kind, location and revision")
        if not all(isinstance(raw[k], str) for k in ("kind", "location")) or not (
            raw["revision"] is None or isinstance(raw["revision"], str)
        ):
            raise FormatError("metadata 'source' holds a value of the wrong type")
        return cls(raw["kind"], raw["location"], raw["revision"])

    def __str__(self) -> str:
        return f"{self.location}@{self.revision}" if self.kind == "hub" else self.location

    @cached_property
    def folder(self) -> Path:
        """The checkpoint's folder here (a hub source is downloaded at its commit, once)."""
        if self.kind == "folder":
            folder = Path(self.location)
        else:
            from huggingface_hub import snapshot_download

            try:
                folder = Path(
                    snapshot_download(
                        self.location, revision=self.revision, allow_patterns=["*.safetensors"]
                    )
                )
            except Exception as exc:  # offline, gated, unknown repo or commit
                raise FormatError(f"cannot download the model source {self}: {exc}") from None
        if not folder.is_dir():
            raise FormatError(f"the model source folder {folder} does not exist here")
        return folder


def resolve_source(model: str) -> ModelSource | None:
    """The source a trainer loading `model` (a local folder or a Hub id) started from: a folder,
    or the Hub repo at the commit its local copy came from (None when that cannot be told)."""
    path = Path(model)
    if path.is_dir():
        return ModelSource("folder", str(path.resolve()))
    if not _REPO.fullmatch(model):
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, allow_patterns=["*.safetensors"]))
    except Exception:  # offline without a cached copy, gated, not a model repo
        return None
    return ModelSource("hub", model, folder.name) if _SHA.fullmatch(folder.name) else None
