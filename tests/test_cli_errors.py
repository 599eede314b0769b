"""User mistakes at the `deltasync` CLI and the benchmarks end in one short error line.

Each case runs the real entry point as a process (`python -m ...`) with a wrong argument - a
missing folder, a file where a folder goes, a bad URL or name, a number out of range - and
expects a nonzero exit, no traceback, exactly one line saying `error:` (argparse's usage lines
may precede it) and nothing created on disk. The arguments are refused before any model is
built, so each case costs an interpreter start and its imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MISSING = "/nonexistent-deltasync-test/bucket"  # never created: checked after every case
A_FILE = str(ROOT / "pyproject.toml")

DELTASYNC = [
    ([], "the following arguments are required: command"),
    (["verify", MISSING], "deltasync: error: no bucket folder at"),
    (["gc", MISSING, "--delete"], "deltasync: error: no bucket folder at"),
    (["replay", A_FILE, "--out", f"{MISSING}-out"], "(it is a file)"),
    (["inspect", "foo://x/file.safetensors"], "deltasync: error: unknown protocol"),
    (["inspect", f"{MISSING}/x.safetensors"], "No such file or directory"),
    (["verify", "hf://models/alice/x"], "is not a bucket URL"),
    (["demo", "--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["demo", "--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
    (["replay", MISSING, "--version", "-2", "--out", "x"], "argument --version: expected an"),
    (["export", MISSING, "--out", f"{MISSING}-out"], "deltasync: error: no bucket folder at"),
    (["export", MISSING, "--to", "alice"], "'alice' is not a Hub repository id"),
    (["export", MISSING], "one of the arguments --to --out is required"),
]

BENCH = [
    ("bench", ["--steps", "0"], "argument --steps: expected an integer >= 1"),
    ("bench", ["--cache", f"{A_FILE}/cache"], "is a file, not a folder"),
    ("bench.replica", ["--workdir", A_FILE], "argument --workdir:"),
    ("bench.replica", ["--synthetic", "2"], "argument --synthetic: expected a number in (0, 1)"),
    ("bench.codec", ["--lr=-1e-6"], "argument --lr: expected a learning rate"),
    ("bench.reader_memory", ["--density", "2"], "argument --density: expected a number in (0, 1)"),
    ("bench.replica_memory", ["--tp", "0"], "argument --tp: expected an integer >= 1"),
    ("bench.codec", ["--json", str(ROOT)], "is a folder; give a file name"),
    ("bench.realistic", ["--seed", "-1"], "argument --seed: expected an integer >= 0"),
    ("bench.chaos", ["--fault-rate", "1"], "argument --fault-rate: expected a number in [0, 1)"),
    ("bench.soak", ["--syncs", "many"], "argument --syncs: expected an integer, got 'many'"),
    ("bench.fleet", ["--workdir", f"{A_FILE}/work"], "is a file, not a folder"),
    ("bench.pause_rtt", ["--delays-ms", "-5"], "argument --delays-ms: expected a number >= 0"),
    ("bench.scaling", ["--density", "0"], "argument --density: expected a number in (0, 1)"),
    ("bench.state_digest", ["--repeat", "0"], "argument --repeat: expected an integer >= 1"),
    ("bench.blocking", ["--steps", "nan"], "argument --steps: expected an integer"),
    ("bench.alt_codecs", ["--steps", "1.5"], "argument --steps: expected an integer"),
    ("bench.anchors", ["--levels", "0"], "argument --levels: expected a zstd level in 1..22"),
    ("bench.sharded", ["--shape", "qwen3-huge"], "argument --shape: invalid choice"),
    ("bench.tp_slices", ["--sizes", "0"], "argument --sizes: expected an integer >= 1"),
    ("bench.detection", ["--real", "qwen3-tiny", "--steps", "0"], "argument --steps: expected"),
    ("bench.detection", [], "give --real SHAPE, --synthetic SHAPE or both"),
    ("bench.gpu", ["--device", "tpu:0"], "argument --device: expected"),
    ("bench.gpu_digest", ["--density", "1.5"], "argument --density: expected a number in (0, 1)"),
    ("bench.wordle_load", ["--url", "ws:/nowhere"], "argument --url: expected http://HOST[:PORT]"),
    ("bench.wordle_load", ["--url", "http://127.0.0.1:9"], "no Wordle server answers /health"),
    ("bench.wordle_load", ["--runs", "0"], "argument --runs: expected an integer >= 1"),
    ("bench.env_runs", ["--steps", "0"], "argument --steps: expected an integer >= 1"),
    ("bench.env_runs", ["--json", str(ROOT)], "is a folder; give a file name"),
]


def _fails_in_one_line(argv: list[str], expected: str) -> None:
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0] == result.stderr.splitlines()[-1], result.stderr
    assert len(lines[0]) < 300 and expected in lines[0], lines[0]
    assert not Path(MISSING).parent.exists()


@pytest.mark.parametrize(("args", "expected"), DELTASYNC, ids=[" ".join(a) for a, _ in DELTASYNC])
def test_deltasync_cli(args, expected):
    _fails_in_one_line(["-m", "deltasync", *args], expected)


@pytest.mark.parametrize(
    ("module", "args", "expected"), BENCH, ids=[f"{m} {' '.join(a)}" for m, a, _ in BENCH]
)
def test_benchmarks(module, args, expected):
    _fails_in_one_line(["-m", module, *args], expected)
