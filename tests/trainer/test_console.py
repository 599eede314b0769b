"""The trainer's console: one line per version on the terminal, everything else in the log file
(also what native code and child processes write), or both with --verbose."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltasync.wire.metrics import ReplicaOutcome, SyncRecord
from trainer.console import last_lines, version_line

REPO = Path(__file__).resolve().parents[2]


def _record(**changes) -> SyncRecord:
    fields = dict(
        run_id="r",
        version=7,
        kind="delta",
        encoding="ans",
        delta_path="runs/r/deltas/7.safetensors",
        anchor_path=None,
        delta_bytes=61_000,
        anchor_bytes=0,
        full_bytes=3_214_080,
        changed_elements=61_000,
        total_elements=1_607_040,
        sparsity=0.962,
        diff_s=0.01,
        encode_s=0.01,
        upload_s=0.01,
        queued_s=0.0,
        committed_at=1.0,
        replicas=(ReplicaOutcome("vllm-0", True, 1, 0.1, 0.04, 0.2),),
        step=6,
        reward_mean=0.148,
    )
    return SyncRecord(**{**fields, **changes})


def test_version_line_has_step_reward_size_ratio_sparsity_and_pause():
    line = version_line(_record())
    assert line == (
        "v7   step 6   reward 0.148 | delta 61.0 KB, 53x smaller, 96.2% unchanged | "
        "paused vllm-0 0.04 s"
    )


def test_version_line_for_an_anchor_a_lagging_replica_and_no_reward():
    record = _record(
        kind="anchor",
        delta_path=None,
        delta_bytes=0,
        anchor_path="runs/r/anchors/7.safetensors",
        anchor_bytes=2_900_000,
        reward_mean=None,
        replicas=(ReplicaOutcome("vllm-0", False, 2, error="down"),),
    )
    assert version_line(record) == (
        "v7   step 6   reward     - | anchor 2.9 MB (full bf16 weights) | paused vllm-0 LAGGING"
    )


_SCRIPT = textwrap.dedent(
    """
    import logging, os, subprocess, sys, warnings
    from pathlib import Path
    from trainer.console import console, quiet_output
    with quiet_output(Path(sys.argv[1]), verbose=sys.argv[2] == "1"):
        print("a print")
        os.write(2, b"native stderr\\n")
        logging.getLogger("trl").info("a library's log line")
        warnings.warn("a library's warning")
        subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
        console.info("v1 the one console line")
    print("after the run")
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_quiet_output_keeps_the_terminal_for_console_lines(tmp_path, verbose):
    log = tmp_path / "train.log"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(log), "1" if verbose else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    raw = ("a print", "native stderr", "a library's log line", "a library's warning")
    written = log.read_text()
    for text in (*raw, "a child process", "v1 the one console line"):
        assert text in written  # the log file always has everything
    terminal = done.stdout + done.stderr
    assert "v1 the one console line" in terminal
    assert "after the run" in done.stdout  # the descriptors were restored
    for text in (*raw, "a child process"):
        assert (text in terminal) == verbose


def test_version_line_for_a_virtual_first_anchor():
    record = _record(
        version=1,
        kind="anchor",
        delta_path=None,
        delta_bytes=0,
        anchor_path="runs/r/anchors/1.safetensors",
        anchor_bytes=2744,
        changed_elements=1_607_040,
        sparsity=0.0,
        step=0,
        reward_mean=None,
    )
    assert version_line(record) == (
        "v1   step 0   reward     - | anchor 2.7 KB: names the checkpoint, no weights uploaded | "
        "paused vllm-0 0.04 s"
    )


def test_version_line_for_a_delta_with_an_anchor():
    record = _record(kind="delta+anchor", anchor_path="runs/r/anchors/7.st", anchor_bytes=3_219_240)
    assert version_line(record) == (
        "v7   step 6   reward 0.148 | delta 61.0 KB, 53x smaller (+ anchor 3.2 MB), 96.2% "
        "unchanged | paused vllm-0 0.04 s"
    )


def test_last_lines_are_the_tail_of_the_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert last_lines(log, 3) == "    line 37\n    line 38\n    line 39"
    assert last_lines(tmp_path / "missing.log") == ""
