"""What a reader needs in host memory: peak RSS beyond its imports and the state it holds.

    python -m bench.reader_memory --sizes 0.25 1 4 --baseline 289abc2 \\
        --json bench/results/reader-memory.json

For each size, a synthetic Qwen3-shaped run (`bench.synthetic`: an anchor, then one delta at
`--density`) is published to a folder, with the config and a tokenizer file that `export` needs.
Each reader then runs in a fresh process, once with this checkout and once with `--baseline` (a
git revision, checked out beside it): `Replica().sync` (a `DictSink`), `python -m deltasync
verify` and `python -m deltasync export`. Each reports its RSS after the imports, its peak RSS
(the kernel's high-water mark) and the bytes it holds (the state, once); the table gives peak
minus imports minus held. Last, `verify` of a bucket whose manifest declares an anchor of
garbage of the largest size, against `verify` of a clean small bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from deltasync.arguments import folder, fraction, json_path, positive

from .models.qwen3 import Shape, build_config
from .output import report

__all__ = ["garbage_anchor_bucket", "make_bucket", "measure", "shape_of_size"]

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
READERS = ("sync", "verify", "export")

_READER = """
import json, os, sys
reader, bucket, model, out, warm = sys.argv[1:6]
import numpy, torch, transformers  # the tensor side, and what export loads:
import transformers.models.qwen3.modeling_qwen3  # (check_fits builds the model on meta)
from deltasync import open_store
from deltasync.replica.replica import Replica
from deltasync.tools import cli
from deltasync.tools.export import version

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def run(bucket, out):
    if reader == "sync":
        replica = Replica()
        replica.sync(open_store(bucket))
        return 0, sum(t.numel() * t.element_size() for t in replica.tensors.values())
    if reader == "verify":
        return cli.main(["verify", bucket, "--quiet"]), None
    return cli.main(["export", bucket, "--model", model, "--out", out, "--quiet"]), None

run(warm, out + "-warm")  # compiles the kernels (numba) on a small bucket: code, not data
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from here
imports = status("VmRSS")
code, held = run(bucket, out)
print(json.dumps({"imports": imports, "peak": status("VmHWM"), "held": held, "exit": code}))
"""


def shape_of_size(gib: float, vocab: int = 32000) -> Shape:
    """A Qwen3 shape (hidden 1024, untied) with about `gib` GiB of bf16 weights."""
    per_layer = 2 * (1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128)
    outer = 2 * (2 * vocab * 1024 + 1024)
    layers = max(1, round((gib * GIB - outer) / per_layer))
    return Shape(1024, layers, 16, 8, 128, 3072, vocab, tied=False)


def make_bucket(folder: Path, gib: float, *, density: float = 0.01, vocab: int = 32000) -> int:
    """A bucket at `folder/bucket` holding an anchor of about `gib` GiB and one delta, and the
    model's config and tokenizer at `folder/model`; returns the state's bytes."""
    from .synthetic import publish_synthetic

    shape = shape_of_size(gib, vocab)
    build_config(shape).save_pretrained(folder / "model")
    (folder / "model" / "tokenizer.json").write_text("{}\n")  # export copies it; nothing reads it
    return publish_synthetic(folder / "bucket", shape, 1, density=density, run_id="memory")


def garbage_anchor_bucket(small: Path, folder: Path, size: int) -> None:
    """A copy of the bucket `small` whose manifest declares, as its anchor, `size` bytes that are
    not a safetensors file (with their true size and digest, so only the header can tell)."""
    import shutil

    import xxhash

    shutil.copytree(small, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    anchor = manifest["anchors"][0]
    (folder / anchor["path"]).unlink()
    garbage = folder / "garbage.tmp"
    hasher = xxhash.xxh3_128()
    with open(garbage, "wb") as f:
        block = os.urandom(MIB)
        for _ in range(size // MIB):
            f.write(block)
            hasher.update(block)
    digest = hasher.hexdigest()
    anchor["path"] = f"{anchor['path'].rsplit('-', 1)[0]}-{digest[:12]}.safetensors"
    anchor["bytes"], anchor["digest"] = size, digest
    garbage.rename(folder / anchor["path"])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def measure(reader: str, folder: Path, warm: Path, code: Path = ROOT) -> dict:
    """One reader over `folder/bucket`, in a fresh process running the code at `code`, after
    a first run over the small bucket `warm/bucket` (which compiles the numeric kernels)."""
    with tempfile.TemporaryDirectory(prefix="reader-memory-") as scratch:
        env = {**os.environ, "PYTHONPATH": str(code), "TQDM_DISABLE": "1"}
        args = [str(folder / "bucket"), str(folder / "model"), str(Path(scratch) / "out")]
        args.append(str(warm / "bucket"))
        done = subprocess.run(
            [sys.executable, "-c", _READER, reader, *args],
            cwd=code, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{reader} crashed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["said"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    return result


def _extra(found: dict, held: int) -> float:
    return (found["peak"] - found["imports"] - (found["held"] or held)) / MIB


@contextlib.contextmanager
def code_trees(baseline: str | None, scratch: Path) -> Iterator[dict[str, Path]]:
    """{"this": this checkout}, and with `baseline` a worktree of that git revision (removed
    afterwards, whatever happened)."""
    codes = {"this": ROOT}
    git = ["git", "-C", str(ROOT), "worktree"]
    if baseline:
        codes["baseline"] = scratch / f"baseline-{baseline}"
        add = [*git, "add", "--detach", str(codes["baseline"]), baseline]
        subprocess.run(add, check=True, capture_output=True)
    try:
        yield codes
    finally:
        if baseline:
            remove = [*git, "remove", "--force", str(codes["baseline"])]
            subprocess.run(remove, check=False, capture_output=True)


def run(sizes: Sequence[float], density: float, baseline: str | None, scratch: Path) -> dict:
    results: dict = {"density": density, "sizes": {}, "baseline": baseline}
    rows = []
    with code_trees(baseline, scratch) as codes:
        clean = scratch / "clean-small"
        make_bucket(clean, 0.02, density=density, vocab=4096)
        for gib in sizes:
            folder = scratch / f"size-{gib}"
            held = make_bucket(folder, gib, density=density)
            found = {
                n: {r: measure(r, folder, clean, code) for r in READERS}
                for n, code in codes.items()
            }
            results["sizes"][str(gib)] = {"held": held, "readers": found}
            for reader in READERS:
                cells = [f"{_extra(found[name][reader], held):.0f}" for name in codes]
                rows.append(f"| {held / MIB:.0f} MiB | {reader} | " + " | ".join(cells) + " |")
        garbage = scratch / "garbage"
        garbage.mkdir()
        garbage_anchor_bucket(clean / "bucket", garbage / "bucket", int(max(sizes) * GIB))
        (garbage / "model").symlink_to(clean / "model")
        refusal = {}
        for name, code in codes.items():
            refusal[name] = {
                "clean": measure("verify", clean, clean, code),
                "garbage": measure("verify", garbage, clean, code),
            }
        results["garbage_anchor"] = {"declared": int(max(sizes) * GIB), "verify": refusal}
    header = "| anchor | reader | " + " | ".join(f"{n} (MiB)" for n in codes) + " |"
    table = [header, "|" + "---|" * (2 + len(codes)), *rows, ""]
    for name in codes:
        clean, bad = (refusal[name][k] for k in ("clean", "garbage"))
        table.append(
            f"- {name}: `verify` of a bucket declaring a {max(sizes):g} GiB anchor of garbage "
            f"peaks {(bad['peak'] - bad['imports']) / MIB:.0f} MiB past its imports (a clean "
            f"small bucket: {(clean['peak'] - clean['imports']) / MIB:.0f} MiB), exit "
            f"{bad['exit']}: {bad['said']}"
        )
    results["markdown"] = "\n".join(table)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reader_memory", description=__doc__)
    parser.add_argument("--sizes", type=positive, nargs="+", default=[0.25, 1, 4])
    parser.add_argument("--density", type=fraction, default=0.01)
    parser.add_argument("--baseline", help="a git revision to compare with, side by side")
    parser.add_argument("--json", type=json_path, help="write the results here")
    parser.add_argument(
        "--scratch", type=folder, help="a folder for the buckets (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reader-memory-", dir=args.scratch) as scratch:
        results = run(args.sizes, args.density, args.baseline, Path(scratch))
    report(results["markdown"], results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
