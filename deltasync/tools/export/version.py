"""`python -m deltasync export`: a committed version as a model repository (weights, config,
tokenizer), written to a folder or uploaded to a Hub model repository.

The destination, Hub login, run, version and model files are checked first, so most mistakes
cost seconds and write nothing. Then the one reader (`Replica`) replays the chain, the result
must match the manifest's full-state digest of that version and fit the model's config (known
only after the replay), and only then is anything written.

Config and tokenizer: a bucket names the model a run started from only in a virtual anchor
(version 1, when the weights still equalled that checkpoint, until retention deletes it);
otherwise `model` (a Hub id or a folder) must name it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from deltasync.errors import ExportError, import_tensor_side
from deltasync.store import Store
from deltasync.tools.export.model_files import model_files
from deltasync.wire.manifest import Manifest, read_manifest

__all__ = ["committed_version", "export"]


def export(
    store: Store,
    *,
    version: int | None = None,
    run_id: str | None = None,
    model: str | None = None,
    out: str | None = None,
    to: str | None = None,
    private: bool = False,
    progress: Callable | None = None,
) -> list[str]:
    """Export one committed version to the folder `out` or the Hub repository `to`; returns
    what was done, as lines to print. Raises `DeltaSyncError` (nothing written) on any problem
    with the bucket, the model or the destination, `MissingExtra` without transformers.

    `progress` wraps the chain's files while they are replayed (e.g. `tqdm`).
    """
    if (out is None) == (to is None):
        raise ExportError("give exactly one destination: a folder (out) or a Hub repository (to)")
    destination = _empty_folder(out) if out is not None else None
    hub = None
    if to is not None:
        from deltasync.tools.export.hub import Hub, validate_target  # only a Hub export needs it

        hub = Hub.logged_in(validate_target(to))
    manifest = read_manifest(store)
    if manifest is None:
        raise ExportError(f"the bucket {store.url} has no manifest (nothing published yet)")
    _check_run(store, manifest, run_id)
    version = committed_version(manifest, version)
    files = model_files(store, manifest, model)

    weights = import_tensor_side("deltasync.tools.export.weights")
    plan = manifest.plan(None, None, version)
    tensors, digest = weights.replay(
        store, manifest, version, plan if progress is None else progress(plan)
    )
    weights.check_fits(tensors, files)
    card = weights.model_card(manifest.run_id, version, digest, files)
    done = [
        f"replayed run {manifest.run_id} to version {version} ({len(plan)} files); "
        f"full-state digest {digest or '(protocol 1: per-tensor digests)'} verified"
    ]
    if hub is None:
        assert destination is not None
        written = _write_folder(
            destination, lambda folder: weights.write_model(tensors, files, folder, card)
        )
        return [*done, f"wrote {destination}: {', '.join(written)}"]
    message = f"deltasync export: run {manifest.run_id} version {version}"
    with tempfile.TemporaryDirectory(prefix="deltasync-export-") as staging:
        weights.write_model(tensors, files, Path(staging), card)
        url = hub.upload(Path(staging), private=private, message=message)
    return [*done, f"uploaded to {url}"]


def committed_version(manifest: Manifest, version: int | None) -> int:
    """`version` (default: the latest) when the bucket can still produce it; otherwise an
    `ExportError` naming the versions it holds."""
    oldest = min(a.version for a in manifest.anchors)
    latest = manifest.latest_version
    target = latest if version is None else version
    if oldest <= target <= latest:
        manifest.plan(None, None, target)  # the one planner: raises if no route remains
        return target
    held = f"versions {oldest}..{latest}" if oldest < latest else f"version {latest} only"
    why = "is not committed yet" if target > latest else "was deleted by retention"
    raise ExportError(f"version {target} of run {manifest.run_id} {why}; the bucket holds {held}")


def _check_run(store: Store, manifest: Manifest, run_id: str | None) -> None:
    """A bucket commits one run (its manifest's); others' files under runs/ are leftovers."""
    if run_id is None or run_id == manifest.run_id:
        return
    others = sorted({p.split("/")[1] for p in store.list("runs")} - {manifest.run_id})
    leftovers = (
        f"; uncommitted files of {others} (`python -m deltasync gc` lists them)" if others else ""
    )
    held = f"it holds run {manifest.run_id!r}"
    raise ExportError(f"run {run_id!r} is not committed in this bucket: {held}{leftovers}")


def _empty_folder(out: str) -> Path:
    """`out` as a destination: missing or an empty folder (an export never overwrites)."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ExportError(f"--out {out} is a file; give a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        raise ExportError(f"--out {out} is not empty; give a new or empty folder")
    return path


def _write_folder(path: Path, write: Callable[[Path], list[str]]) -> list[str]:
    """Write into a hidden sibling folder, then rename it into place: a failed export leaves
    no half-written model behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.export-{secrets.token_hex(4)}"
    staging.mkdir()  # as the user's umask says (mkdtemp would make it private)
    try:
        written = write(staging)
        os.replace(staging, path)  # replaces an empty folder, never a full one
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written
