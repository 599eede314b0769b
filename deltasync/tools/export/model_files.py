"""Where an export's config and tokenizer come from: the model a user names, or the checkpoint
a run's virtual anchor records (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from deltasync.errors import ExportError
from deltasync.store import Store
from deltasync.wire.encodings import holds_weights
from deltasync.wire.manifest import Manifest, fetch_entry
from deltasync.wire.metadata import ParsedFile
from deltasync.wire.source import ModelSource

__all__ = ["ModelFiles", "model_files"]

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "*.tiktoken",
)
_MODEL_FILES = (*CONFIG_FILES, *TOKENIZER_FILES)
_TOKENIZER_PROOF = ("tokenizer.json", "tokenizer.model", "vocab*", "*.tiktoken")


@dataclass(frozen=True)
class ModelFiles:
    """A folder holding a model's config and tokenizer; `name` says where it came from, and
    `hub_id` is the Hub repository when there is one (the model card's `base_model`)."""

    folder: Path
    name: str
    hub_id: str | None = None

    def files(self) -> list[Path]:
        """The config and tokenizer files to copy (top level only; never weights)."""
        return sorted(
            p
            for p in self.folder.iterdir()
            if p.is_file() and any(fnmatch(p.name, pattern) for pattern in _MODEL_FILES)
        )


def model_files(store: Store, manifest: Manifest, model: str | None) -> ModelFiles:
    """Where config and tokenizer come from: `model` (a folder or a Hub id) when given, else
    the checkpoint the run's virtual anchor names, while the bucket still holds it."""
    if model is not None:
        found = _named_model(model)
    else:
        source = _recorded_source(store, manifest)
        if source is None:
            raise ExportError(
                f"the bucket does not record the model run {manifest.run_id} started from (only "
                "a virtual anchor at version 1 does, and this bucket holds none): pass --model "
                "HUB_ID_OR_FOLDER, the model the trainer loaded, for config and tokenizer"
            )
        found = _source_files(source)
    if not (found.folder / "config.json").is_file():
        raise ExportError(f"{found.name} has no config.json: pass the model the trainer loaded")
    if not any(fnmatch(p.name, t) for p in found.files() for t in _TOKENIZER_PROOF):
        raise ExportError(
            f"{found.name} has no tokenizer (tokenizer.json, tokenizer.model, vocab...): pass "
            "--model with the trainer's tokenizer"
        )
    return found


def _named_model(model: str) -> ModelFiles:
    folder = Path(model).expanduser()
    if folder.is_dir():
        return ModelFiles(folder.resolve(), str(folder))
    if folder.exists():
        raise ExportError(f"--model {model} is a file, not a model folder or Hub id")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ExportError(f"--model {model}: no such folder")
    from deltasync.tools.export.hub import download_model_files

    return ModelFiles(download_model_files(model, None, _MODEL_FILES), model, model)


def _recorded_source(store: Store, manifest: Manifest) -> ModelSource | None:
    """The checkpoint a retained virtual anchor names (a small file), if there is one."""
    for entry in manifest.anchors:
        if not holds_weights(entry.encoding) and entry.parts is None:
            data = fetch_entry(store, entry)
            assert isinstance(data, bytes)  # an entry without parts is one file
            return ParsedFile.parse(data, path=entry.path).meta.source
    return None


def _source_files(source: ModelSource) -> ModelFiles:
    if source.kind == "hub":
        from deltasync.tools.export.hub import download_model_files

        folder = download_model_files(source.location, source.revision, _MODEL_FILES)
        return ModelFiles(folder, str(source), source.location)
    folder = Path(source.location)
    if not folder.is_dir():
        raise ExportError(
            f"the run started from the folder {folder}, which does not exist here: pass --model "
            "HUB_ID_OR_FOLDER for config and tokenizer"
        )
    return ModelFiles(folder, str(folder))
