"""The benchmark tools stay runnable: `python -m bench` and the synthetic generator."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.__main__ import main
from bench.synthetic import parameter_shapes, synthetic_states
from deltasync.arguments import scratch


def test_bench_command_prints_the_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--model", "qwen3-tiny", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("| step | density | full MB | coo MB | packed MB", "Trainer side"):
        assert heading in printed
    result = json.loads(out.read_text())
    assert [r["step"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert 0 < row["density"] < 0.2  # AdamW at lr 1e-6: a few percent of bf16 elements move
        assert row["packed_bytes"] * 3 < row["coo_bytes"] < row["full_bytes"]
        assert row["packed_bits"] >= row["floor"]  # nothing beats the entropy floor
        assert row["train_step_s"] > 0 and row["snapshot_bytes"] == row["full_bytes"]


def test_synthetic_steps_move_the_requested_share_by_small_bit_steps():
    states = synthetic_states("qwen3-tiny", 2, density=0.02, seed=3)
    _, state = next(states)
    assert {n: tuple(t.shape) for n, t in state.items()} == parameter_shapes("qwen3-tiny")
    before = {n: t.clone() for n, t in state.items()}
    for _, state in states:
        moved = changed = total = 0
        for name, tensor in state.items():
            old = before[name].view(-1).view(torch.int16).numpy().astype(np.int32)
            new = tensor.view(-1).view(torch.int16).numpy().astype(np.int32)
            step = np.abs(new - old)
            changed += int((step > 0).sum())
            moved += int((step == 1).sum())
            total += new.size
            before[name] = tensor.clone()
        assert 0.015 < changed / total < 0.021
        assert 0.85 < moved / changed < 0.93


def test_state_digest_bench_prints_the_three_passes(tmp_path, capsys):
    from bench.state_digest import main as state_digest_main

    out = tmp_path / "digest.json"
    assert state_digest_main(["--model", "qwen3-tiny", "--repeat", "1", "--json", str(out)]) == 0
    assert "| digest update |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"xxh3 pass", "digest recompute", "digest update"}
    assert 0.015 < result["density"] < 0.025 and result["changed"] > 0


def test_sharded_bench_reports_every_rank(tmp_path, capsys):
    """`python -m bench.sharded` runs torchrun for 1 and 2 ranks and reports each rank."""
    from bench.sharded import main as sharded

    out = tmp_path / "sharded.json"
    assert (
        sharded(["--shape", "qwen3-tiny", "--ranks", "1", "2", "--steps", "1", "--json", str(out)])
        == 0
    )
    assert "| ranks | rank | shard bf16 MB" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [f["rank"] for f in results["2"]] == [0, 1] and len(results["1"]) == 1
    whole = results["1"][0]["shard_bytes"]
    assert sum(f["shard_bytes"] for f in results["2"]) == whole  # the ranks split the model
    for figures in results["2"]:
        (step,) = figures["steps"]
        assert step["bytes"] > 0 and 0 < step["changed"] < step["elements"]


def test_tp_slices_bench_splits_what_each_worker_holds(tmp_path, capsys, monkeypatch):
    """`python -m bench.tp_slices` replays a run as TP 1 and TP 2 workers: the two workers
    together hold one model and each reads less of an anchor than a whole replica."""
    from bench.tp_slices import main as tp_slices

    # the tiny model's anchor is smaller than the head read with its header, its tensors close
    monkeypatch.setattr("deltasync.wire.stored.HEAD_BYTES", 4096)
    monkeypatch.setattr("deltasync.wire.stored.MERGE_GAP", 0)

    out = tmp_path / "tp.json"
    tp_slices(["--shape", "qwen3-tiny", "--deltas", "2", "--json", str(out)])
    assert "| replica | worker | anchor read MB" in capsys.readouterr().out
    results = json.loads(out.read_text())
    (whole,), pair = results["tp1"], results["tp2"]
    assert sum(w["held_mb"] for w in pair) < whole["held_mb"] * 1.05  # norms held by both
    assert all(w["held_mb"] < 0.6 * whole["held_mb"] for w in pair)
    assert min(w["anchor_read_mb"] for w in pair) < 0.8 * whole["anchor_read_mb"]


def test_tp_slices_bench_with_expert_parallelism_reads_each_expert_once(
    tmp_path, capsys, monkeypatch
):
    """`--expert-parallel` on a Qwen3-MoE shape: each TP 2 + EP worker reads exactly half of
    the anchor's expert bytes (its experts whole), where a TP 2 worker reads a slice of every
    expert; both hold half of the experts."""
    from bench.tp_slices import main as tp_slices

    monkeypatch.setattr("deltasync.wire.stored.HEAD_BYTES", 4096)
    monkeypatch.setattr("deltasync.wire.stored.MERGE_GAP", 0)

    out = tmp_path / "tp.json"
    args = ["--shape", "qwen3-moe-tiny", "--deltas", "1", "--expert-parallel"]
    tp_slices([*args, "--json", str(out)])
    assert "| TP 2 + EP | 1 |" in capsys.readouterr().out
    results = json.loads(out.read_text())
    experts = results["anchor_expert_bytes"] / 1e6
    (whole,) = results["tp1"]
    assert whole["anchor_expert_read_mb"] == pytest.approx(experts)
    for worker in results["tp2-ep"]:
        assert worker["anchor_expert_read_mb"] == pytest.approx(experts / 2)
    for sliced, ep in zip(results["tp2"], results["tp2-ep"], strict=True):
        assert 0 < sliced["anchor_expert_read_mb"] < experts
        assert ep["held_mb"] == pytest.approx(sliced["held_mb"])


def test_a_missing_workdir_is_created(tmp_path):
    """`--workdir DIR` of a benchmark: a DIR that does not exist yet is made, parents too."""
    work = scratch(str(tmp_path / "new" / "dir"), "deltasync-bench-")
    assert work.is_dir() and work.parent == tmp_path / "new" / "dir"
    assert work.name.startswith("deltasync-bench-") and list(work.iterdir()) == []


def test_ctx_bounds_bench_reports_heavy_tails_and_late_steps(tmp_path, capsys):
    from bench.ctx_bounds import main as bounds

    out = tmp_path / "bounds.json"
    args = ["--model", "qwen3-tiny", "--steps", "4", "--shrink", "4", "--json", str(out)]
    assert bounds(args) == 0
    assert "| Student-t (3), per-tensor scales" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["lr"] for r in result["heavy_tailed"]] == [1e-6, 3e-6]
    assert [r["step"] for r in result["late"]] == [3, 4]
    for row in result["heavy_tailed"]:  # the exponent predicts the change: ctx codes it in less
        assert 0 < row["density"] < 0.5 and row["ctx_vs_ans"] < 0.85


def test_blocking_bench_publishes_each_encoding_side_by_side(tmp_path, capsys):
    from bench.blocking import main as blocking

    out = tmp_path / "blocking.json"
    args = ["--model", "qwen3-tiny", "--steps", "2", "--repeat", "1", "--train-s", "0.05"]
    assert blocking([*args, "--encodings", "ans", "ctx", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| encoding | publish blocks s (median) | vs ans |" in printed
    saved = json.loads(out.read_text())
    assert saved["markdown"] in printed  # the tables bench.report checks the docs against
    published = saved["publish"]
    assert list(published) == ["none", "ans", "ctx", "none after"]
    for encoding in ("ans", "ctx"):  # every step published, its delta written by the worker
        rows = published[encoding]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["delta_bytes"] > 0 and r["publish_s"] > 0 for r in rows)


def test_entropy_coder_bench_splits_integers_as_rans_does():
    """bench.entropy_coders hands constriction the symbols `codec.rans` codes: its escape bits
    fill exactly the raw bytes a rans stream of the same integers declares."""
    from bench.entropy_coders import symbols
    from deltasync.codec.rans import DIRECT, _get_leb128, encode_integers

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.integers(0, DIRECT, 500), rng.integers(DIRECT, 1 << 40, 300)])
    split, escape_bits = symbols(values)
    assert np.array_equal(split[:500], values[:500]) and (split[500:] >= DIRECT).all()
    stream = encode_integers(values, 0)
    size, p = _get_leb128(stream, 1)
    for _ in range(int(size)):
        _, p = _get_leb128(stream, p)
    raw_bytes, _ = _get_leb128(stream, p)
    assert raw_bytes == (escape_bits + 7) // 8


def test_entropy_coder_bench_bit_lengths_are_exact_near_powers_of_two():
    from bench.entropy_coders import symbols
    from deltasync.codec.rans import DIRECT

    k = np.arange(6, 58)
    values = np.concatenate([(1 << k) - 1, 1 << k[:-1]]).astype(np.int64)
    split, escape_bits = symbols(values)
    lengths = np.array([int(v).bit_length() for v in values])
    assert np.array_equal(split, DIRECT - 6 + lengths)
    assert escape_bits == int((lengths - 1).sum())
