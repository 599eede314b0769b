"""The tensor side of `export`: replay a version with the one reader, verify it, check that it
fits the model's config, and write it as an HF checkpoint folder (bf16 safetensors, sharded as
`save_pretrained` does, with the model's config, tokenizer and a model card).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from deltasync.errors import DigestMismatch, ExportError, MissingExtra
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.checkpoint_names import CheckpointNames
from deltasync.replica.replay import replay as replay_chain
from deltasync.replica.replica import Replica
from deltasync.store import Store
from deltasync.tools.export.model_files import ModelFiles
from deltasync.wire.manifest import ChainEntry, Manifest

__all__ = ["check_fits", "model_card", "replay", "write_model", "write_safetensors"]

MAX_SHARD = "5GB"  # as `save_pretrained`; the Hub takes files up to 50 GB


def replay(
    store: Store, manifest: Manifest, version: int, plan: Iterable[ChainEntry]
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The bf16 state at `version` (applying `plan`, the planner's files for it, through a
    `Replica`, which verifies each) and its full-state digest, recomputed over the result and
    checked against the manifest's. None for a protocol 1 version, which has no such digest
    (its files' per-tensor digests were checked instead)."""
    replica = Replica()
    replay_chain(store, plan, replica, streaming=False)  # deltas written into the anchor's tensors
    tensors = dict(replica.tensors)
    expected = manifest.version_digest(version)
    if expected is None:
        return tensors, None
    found = full_state_digest(tensors).hex()
    if found != expected:
        raise DigestMismatch(
            "",
            expected,
            found,
            message=f"version {version} replayed to full-state digest {found}, the manifest "
            f"says {expected}; nothing was written",
        )
    return tensors, found


def check_fits(tensors: dict[str, torch.Tensor], files: ModelFiles) -> None:
    """The checkpoint tensors of the model `AutoModelForCausalLM` builds from the config (on
    the meta device: no memory) must be exactly these names and shapes; else the config is
    another model's."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise MissingExtra(
            "export checks the model's config with transformers "
            f"(pip install 'deltasync[export]'): {exc}"
        ) from None
    try:
        config = AutoConfig.from_pretrained(files.folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:  # unknown model type, remote code, bad JSON
        line = " ".join(str(exc).split())[:300]
        raise ExportError(
            f"cannot build a causal LM from the config of {files.name}: {line}"
        ) from None
    held = CheckpointNames.of(model).apply(model.named_parameters())  # the checkpoint's names
    expected = {n: tuple(t.shape) for n, t in held}
    found = {n: tuple(t.shape) for n, t in tensors.items()}
    if expected == found:
        return
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    shapes = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    what = [
        f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}"
        for label, names in (("lacks", missing), ("has no", extra), ("reshapes", shapes))
        if names
    ]
    raise ExportError(
        f"the weights do not fit the config of {files.name} (it {'; '.join(what)}): pass the "
        "--model the run trained"
    )


def model_card(run_id: str, version: int, digest: str | None, files: ModelFiles) -> str:
    """README.md: where the weights come from, with Hub metadata."""
    base = f"base_model: {files.hub_id}\n" if files.hub_id else ""
    check = f"full-state digest `{digest}`" if digest else "per-tensor digests"
    return (
        f"---\nlibrary_name: transformers\n{base}tags:\n- deltasync\n---\n\n"
        f"# {run_id}, version {version}\n\n"
        f"Version {version} of the deltasync run `{run_id}`: the bf16 weights its replicas serve "
        f"at that version, replayed from the bucket's anchor and deltas and verified ({check}). "
        f"Config and tokenizer: {files.name}.\n"
    )


_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, *, metadata: Mapping[str, str]
) -> None:
    """A safetensors file written tensor by tensor straight from the tensors' memory: nothing
    of it is held beside them (`safetensors.torch.save_file` assembles the whole file in memory
    first, a second copy of a shard of up to `MAX_SHARD`)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(tensors):
            f.write(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())


def write_model(
    tensors: dict[str, torch.Tensor],
    files: ModelFiles,
    folder: Path,
    card: str,
    *,
    max_shard_size: int | str = MAX_SHARD,
) -> list[str]:
    """Weights (one safetensors file, or shards plus their index), config (dtype bf16: what
    the weights are), tokenizer and card into `folder`; returns the names written."""
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors[name] for name in names}
        write_safetensors(shard, folder / filename, metadata={"format": "pt"})
    written = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        written.append("model.safetensors.index.json")
    for path in files.files():
        if path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = "bfloat16"
            if "torch_dtype" in config:  # the key before transformers 4.56
                config["torch_dtype"] = "bfloat16"
            (folder / path.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile(path, folder / path.name)
        written.append(path.name)
    (folder / "README.md").write_text(card)
    return [*written, "README.md"]
