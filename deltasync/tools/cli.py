"""`python -m deltasync`: demo, inspect a file, verify a bucket's chain, materialise a checkpoint,
export a version as a model repository, check a replica against a fresh load, remove garbage,
compile the codec's loops ahead of a run.

Examples:
    python -m deltasync demo --bucket ./bucket --steps 30
    python -m deltasync inspect ./bucket/runs/r1/deltas/00000002-0123456789ab.safetensors
    python -m deltasync verify ./bucket
    python -m deltasync replay s3://my-bucket/rl --version 40 --out ./ckpt-40
    python -m deltasync export ./bucket --version 40 --out ./model-40
    python -m deltasync export hf://buckets/me/rl --to me/qwen3-grpo --model Qwen/Qwen3-0.6B
    python -m deltasync gc ./bucket --delete
    python -m deltasync check ./bucket --replica http://127.0.0.1:8001
    python -m deltasync warm-up

User mistakes end in one line (`deltasync: error: ...`, exit status 1; `--debug` shows the
traceback); argument errors are argparse's (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import fsspec
from tqdm import tqdm

from deltasync import settings
from deltasync.arguments import count, http_url, learning_rate
from deltasync.codec import ENCODINGS, read_metadata
from deltasync.defaults import ENCODING
from deltasync.errors import (
    DeltaSyncError,
    FormatError,
    MissingExtra,
    StoreError,
    import_tensor_side,
)
from deltasync.replica.replay import replay
from deltasync.store import Store, open_store
from deltasync.wire.garbage import find_abandoned, find_unreferenced, remove_paths
from deltasync.wire.manifest import ChainEntry, Manifest, fetch_entry, read_manifest

__all__ = ["main"]


def _existing_bucket(url: str) -> Store:
    """A bucket to read: a folder must exist (`open_store` creates a missing one, as a
    publisher needs, which would hide a mistyped path behind 'no manifest')."""
    if "://" not in url or url.startswith("file://"):
        folder = Path(url.removeprefix("file://")).expanduser()
        if not folder.is_dir():
            raise StoreError(
                f"no bucket folder at {url}" + (" (it is a file)" if folder.exists() else "")
            )
    return open_store(url)


def _published(url: str) -> tuple[Store, Manifest]:
    """An existing bucket with something committed, and its manifest."""
    store = _existing_bucket(url)
    manifest = read_manifest(store)
    if manifest is None:
        raise FormatError("bucket has no manifest (nothing published yet)", path=url)
    return store, manifest


def _inspect(args: argparse.Namespace) -> int:
    if "://" in args.file and args.file.split("://", 1)[0] not in fsspec.available_protocols():
        raise StoreError(f"unknown protocol in {args.file!r}; give a path or an fsspec URL")
    with fsspec.open(args.file, "rb", block_size=64 * 1024) as f:
        size = f.size

        def read(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start)

        meta, header = read_metadata(read, size, path=args.file)
    summary = {
        "file": args.file,
        "bytes": size,
        "kind": meta.kind,
        "encoding": meta.encoding,
        "run_id": meta.run_id,
        "version": meta.version,
        "base_version": meta.base_version,
        "total_elements": meta.total_elements,
        "changed_elements": meta.changed_elements,
        "sparsity": round(meta.sparsity, 6),
        "legacy_trl_v1": meta.legacy,
        "state_digest": meta.state_digest and meta.state_digest.hex(),
        "part": meta.part and f"{meta.part.index} of {meta.part.count}",
        "stored_tensors": len(header.tensors),
    }
    if args.json:
        summary["tensors"] = {
            n: {"shape": e.shape, "changed": e.changed, "digest": e.digest}
            for n, e in meta.tensors.items()
        }
        print(json.dumps(summary, indent=1))
        return 0
    for key, value in summary.items():
        print(f"{key:>17}: {value}")
    if args.tensors:
        for name, entry in meta.tensors.items():
            print(f"  {name:<60} {entry.changed:>10}/{entry.numel:<10} {entry.digest}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Replay every retained file from the oldest anchor; check every byte of each later anchor
    against the replay (streamed, never held beside it) and, at the end, the whole replayed
    state against its full-state digest and the last file's per-tensor digests."""
    Replica = import_tensor_side("deltasync.replica.replica").Replica
    full_state_digest = import_tensor_side("deltasync.kernels.state_hash").full_state_digest
    compare_anchor = import_tensor_side("deltasync.codec.anchors").compare_anchor

    store, manifest = _published(args.bucket)
    oldest, *later_anchors = sorted(manifest.anchors, key=lambda a: a.version)
    replica = Replica()
    anchors = {a.version: a for a in later_anchors}
    checked = []

    def check_anchor(delta: ChainEntry) -> None:  # every retained anchor against the replay
        if delta.version not in anchors:
            return
        found = fetch_entry(store, anchors[delta.version], shapes=replica.sink.shapes())
        for file in found if isinstance(found, tuple) else (found,):
            part = file.meta.part
            compare_anchor(file, replica.tensors, rows=part.rows if part else None)
        checked.append(delta.version)

    chain = [oldest, *manifest.deltas_after(oldest.version)]
    # up to the next retained anchor, one update: each delta written into the anchor's tensors
    # as it decodes (one state held); from there one file at a time, checked at each anchor
    first = next((i for i, e in enumerate(chain) if e.version in anchors), len(chain) - 1) + 1
    bar = tqdm(total=len(chain), desc="verify", unit="version", disable=args.quiet)
    replay(store, _counted(chain[:first], bar), replica, streaming=False)
    check_anchor(chain[first - 1])
    replay(store, _counted(chain[first:], bar), replica, after=check_anchor)
    bar.close()
    last = chain[-1]
    if last.kind == "delta" and last.version not in checked:
        data = fetch_entry(store, last)
        if isinstance(data, bytes):  # a sharded delta's digest was checked when it was applied
            replica.check_digests(read_metadata(lambda a, b: data[a:b], len(data))[0])
    recomputed = full_state_digest(replica.tensors)
    if replica.state_digest != recomputed:
        raise FormatError(
            f"replayed state has full-state digest {recomputed}, its files promised "
            f"{replica.state_digest}",
            path=args.bucket,
        )
    retired = (
        f"; versions 1..{oldest.version - 1} were retired by the anchor policy"
        if oldest.version > 1
        else ""
    )
    print(
        f"ok: run {manifest.run_id}, versions {oldest.version}..{manifest.latest_version} "
        f"replayed from the oldest anchor the bucket keeps{retired}: "
        f"{len(manifest.anchors)} anchors and {len(manifest.deltas)} deltas verified "
        f"(state digest {recomputed})"
    )
    return 0


def _counted(entries: list[ChainEntry], bar: tqdm) -> Iterator[ChainEntry]:
    for entry in entries:
        yield entry
        bar.update()


def _replay(args: argparse.Namespace) -> int:
    anchor_metadata = import_tensor_side("deltasync.codec.files").anchor_metadata
    Replica = import_tensor_side("deltasync.replica.replica").Replica
    write_safetensors = import_tensor_side("deltasync.tools.export.weights").write_safetensors

    store, manifest = _published(args.bucket)
    version = manifest.latest_version if args.version is None else args.version
    plan = manifest.plan(None, None, version)
    replica = Replica()
    bar = tqdm(plan, desc="replay", unit="file", disable=args.quiet)
    replay(store, bar, replica, streaming=False)  # deltas written into the anchor's tensors
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = anchor_metadata(
        replica.tensors, run_id=manifest.run_id, version=version, state_digest=replica.state_digest
    )
    path = out / "model.safetensors"
    write_safetensors(replica.tensors, path, metadata=metadata)  # from the tensors, not a copy
    print(
        f"wrote {path} (run {manifest.run_id}, version {version}, "
        f"{path.stat().st_size / 1e6:.1f} MB)"
    )
    return 0


def _gc(args: argparse.Namespace) -> int:
    """List (and with --delete remove) the chain files no manifest names, and uploads a killed
    writer left unfinished over an hour ago."""
    store = _existing_bucket(args.bucket)
    manifest = read_manifest(store)
    garbage = find_unreferenced(store, manifest)
    sizes = {path: store.size(path) for path in garbage}
    abandoned = find_abandoned(store)
    for path, size in (sizes | abandoned).items():
        print(f"{size:>14,d}  {path}")
    count, megabytes = len(sizes) + len(abandoned), sum((sizes | abandoned).values()) / 1e6
    total = f"{count} unreferenced files, {megabytes:.1f} MB"
    if abandoned:
        total += f" ({len(abandoned)} of them uploads never finished)"
    if manifest is None and garbage:
        total += " (the bucket has no manifest: every chain file counts)"
    if not args.delete:
        print(f"{total}; dry run: pass --delete to remove them")
        return 0
    paths = tqdm(garbage, desc="deleting", disable=args.quiet or not garbage)
    removed = remove_paths(store, list(paths), list(abandoned))
    if len(removed) < count:
        print(f"removed {len(removed)} of {total}; the rest could not be removed (logged)")
        return 1
    print(f"removed {total}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from deltasync.tools.export.version import export

    if args.quiet:  # the Hub client's own upload bars too
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    store = _existing_bucket(args.bucket)
    lines = export(
        store,
        version=args.version,
        run_id=args.run_id,
        model=args.model,
        out=args.out,
        to=args.to,
        private=args.private,
        progress=None if args.quiet else lambda plan: tqdm(plan, desc="replay", unit="file"),
    )
    print("\n".join(lines))
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        from deltasync.tools import check
    except ImportError as exc:
        raise MissingExtra(f"check loads a reference in vLLM (deltasync[local]): {exc}") from None
    store = _existing_bucket(args.bucket)
    if args.replica:
        token = settings.API_KEY.read() or None
        lines = check.check_replica(store, args.replica, token, model=args.model)
    else:
        lines = check.check_folder(store, args.folder, version=args.version, model=args.model)
    print("\n".join(lines))
    return 0


def _demo(args: argparse.Namespace) -> int:
    run_demo = import_tensor_side("deltasync.tools.demo").run_demo
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return 1 if run_demo(args.bucket, args.steps, args.lr, args.encoding) else 0


def _warm_up(args: argparse.Namespace) -> int:
    warm_up = import_tensor_side("deltasync.tools.warm").warm_up
    print(f"codec loops compiled and cached ({args.encoding}): {warm_up(args.encoding):.1f} s")
    return 0


def _repo_id(text: str) -> str:
    from deltasync.tools.export.hub import validate_target

    try:
        return validate_target(text)
    except DeltaSyncError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--to ")) from None


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a committed version as a model repository (weights, config, tokenizer): a folder "
        "(--out) or a Hub upload (--to)",
        description="Replay a committed version of the bucket's run, verify it against the "
        "manifest's full-state digest, and write it as a model repository that transformers "
        "and vLLM load: bf16 safetensors, config.json, tokenizer and README.md. Config and "
        "tokenizer come from --model, or else from the checkpoint the run's version-1 virtual "
        "anchor names (while the bucket still holds it).",
    )
    p.add_argument("bucket", help="folder, hf://buckets/NS/NAME, s3://..., memory://...")
    p.add_argument("--version", type=count, default=None, help="version (default: the latest)")
    p.add_argument("--run-id", default=None, help="refuse unless the bucket's run is this one")
    p.add_argument(
        "--model",
        default=None,
        help="Hub id or folder of the model the trainer loaded: its config and tokenizer "
        "(default: the checkpoint the run's virtual anchor names)",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--to", type=_repo_id, metavar="OWNER/REPO", help="upload to this model repo"
    )
    where.add_argument("--out", metavar="DIR", help="write this folder instead (new or empty)")
    p.add_argument("--private", action="store_true", help="create the Hub repository private")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_export)


_ENCODING_FLAG = ("--encoding",)
_ENCODING_OPTIONS = {
    "choices": ENCODINGS,
    "default": ENCODING,
    "help": "delta encoding (default %(default)s)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deltasync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model and sync it through a local bucket")
    p.add_argument("--bucket", default="./bucket", help="bucket folder or URL (default ./bucket)")
    p.add_argument("--steps", type=count, default=30, help="versions to publish (default 30)")
    p.add_argument(
        "--lr", type=learning_rate, default=1e-6, help="AdamW learning rate (default 1e-6)"
    )
    p.add_argument(*_ENCODING_FLAG, **_ENCODING_OPTIONS)
    p.set_defaults(run=_demo)
    p = sub.add_parser(
        "warm-up",
        help="compile the codec's loops now (cached on disk), so a run's first versions are "
        "not delayed by compilation",
    )
    p.add_argument(*_ENCODING_FLAG, **_ENCODING_OPTIONS)
    p.set_defaults(run=_warm_up)
    p = sub.add_parser("inspect", help="print a file's metadata (reads only its header)")
    p.add_argument("file", help="local path or fsspec URL of an anchor or delta")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_inspect)
    p = sub.add_parser("verify", help="replay a bucket's chain and check every digest")
    p.add_argument("bucket", help="folder, hf://buckets/NS/NAME, s3://..., memory://...")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_verify)
    p = sub.add_parser("replay", help="materialise the checkpoint of one version")
    p.add_argument("bucket", help="folder, hf://buckets/NS/NAME, s3://..., memory://...")
    p.add_argument("--version", type=count, default=None, help="version (default: latest)")
    p.add_argument("--out", required=True, help="output folder for model.safetensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_replay)
    _add_export(sub)
    p = sub.add_parser(
        "check",
        help="check a live replica (or a model folder) against a fresh load of the bucket's "
        "version",
        description="--replica: export the version the replica serves, load it into a new vLLM "
        "engine, and compare both engines' logprobs of a fixed prompt (identical, or the check "
        "fails). Works for any model family. The replica's token is read from "
        "DELTASYNC_API_KEY. --folder: compare a model folder's tensors with the version's, "
        "bit for bit.",
    )
    p.add_argument("bucket", help="folder, hf://buckets/NS/NAME, s3://..., memory://...")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--replica", type=http_url, metavar="URL", help="a running replica")
    what.add_argument("--folder", metavar="DIR", help="a model folder (safetensors)")
    p.add_argument(
        "--version", type=count, default=None, help="--folder: version (default: latest)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hub id or folder with the config and tokenizer (default: the run's virtual anchor)",
    )
    p.set_defaults(run=_check)
    p = sub.add_parser(
        "gc",
        help="list anchors, deltas and parts no manifest names (failed, fenced or replaced "
        "runs' files); --delete removes them",
    )
    p.add_argument("bucket", help="folder, hf://buckets/NS/NAME, s3://..., memory://...")
    p.add_argument("--delete", action="store_true", help="remove them (default: dry run)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (DeltaSyncError, OSError, MissingExtra) as exc:  # e.g. a version not retained
        if args.debug:
            raise
        print(f"deltasync: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltasync: interrupted", file=sys.stderr)
        return 130
