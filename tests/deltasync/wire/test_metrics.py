"""The metrics record: exact keys, checked types, bounded size, one writer, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltasync.errors import FormatError
from deltasync.wire.metrics import MAX_RECORD_BYTES, ReplicaOutcome, SyncRecord


def _record(**changes) -> SyncRecord:
    fields = {
        "run_id": "run-a",
        "version": 3,
        "kind": "delta",
        "encoding": "packed",
        "delta_path": "runs/run-a/deltas/00000003-0123456789ab.safetensors",
        "anchor_path": None,
        "delta_bytes": 1200,
        "anchor_bytes": 0,
        "full_bytes": 200_000,
        "changed_elements": 1000,
        "total_elements": 100_000,
        "sparsity": 0.99,
        "diff_s": 0.01,
        "encode_s": 0.02,
        "upload_s": 0.03,
        "queued_s": 0.0,
        "committed_at": 1795952223.9,
    }
    return SyncRecord(**(fields | changes))


def _complete() -> SyncRecord:
    return _record().with_sync(
        (
            ReplicaOutcome("vllm-0", True, 1, 0.4, 0.02, 0.5),
            ReplicaOutcome("vllm-1", False, 2, total_s=3.0, error="connection refused"),
        ),
        sync_s=0.6,
        step=2,
        reward_mean=0.25,
    )


def _outcome(**changes) -> dict:
    base = {"ok": True, "attempts": 1, "stage_s": 0, "pause_s": 0, "total_s": 0, "error": None}
    return base | changes


def _raw(record: SyncRecord) -> dict:
    return json.loads(record.to_json())


def test_round_trip_publisher_only_and_complete():
    for record in (_record(), _complete()):
        assert SyncRecord.from_json(record.to_json()) == record


def test_json_has_every_key_and_replicas_by_name():
    raw = _raw(_complete())
    assert sorted(raw) == sorted(
        [
            *("run_id", "version", "kind", "encoding", "delta_path", "anchor_path"),
            *("delta_bytes", "anchor_bytes", "full_bytes", "changed_elements", "total_elements"),
            *("sparsity", "diff_s", "encode_s", "upload_s", "queued_s", "committed_at"),
            *("replicas", "sync_s", "step", "reward_mean"),
        ]
    )
    assert raw["replicas"] == {
        "vllm-0": {
            "ok": True,
            "attempts": 1,
            "stage_s": 0.4,
            "pause_s": 0.02,
            "total_s": 0.5,
            "error": None,
            "latency_s": None,
            "served_version": None,
            "following": False,
        },
        "vllm-1": {
            "ok": False,
            "attempts": 2,
            "stage_s": 0.0,
            "pause_s": 0.0,
            "total_s": 3.0,
            "error": "connection refused",
            "latency_s": None,
            "served_version": None,
            "following": False,
        },
    }
    publisher_only = _raw(_record())
    assert publisher_only["replicas"] == {} and publisher_only["step"] is None


def test_record_without_trainer_keys_reads():
    """Records written by a publisher alone before the trainer keys existed."""
    raw = _raw(_record())
    for key in ("replicas", "sync_s", "step", "reward_mean"):
        del raw[key]
    record = SyncRecord.from_json(json.dumps(raw).encode())
    assert record.replicas == () and record.step is None and record.reward_mean is None


def test_unknown_key_is_refused_naming_the_expected_ones():
    raw = _raw(_record()) | {"reward": 0.5}
    with pytest.raises(FormatError, match=r"unknown keys \['reward'\]; expected \[.*'reward_mean'"):
        SyncRecord.from_json(json.dumps(raw).encode(), path="runs/run-a/metrics/00000003.json")


def test_missing_publisher_key_is_refused():
    raw = _raw(_record())
    del raw["sparsity"]
    with pytest.raises(FormatError, match=r"missing keys \['sparsity'\].*in runs/x.json"):
        SyncRecord.from_json(json.dumps(raw).encode(), path="runs/x.json")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("version", 0),
        ("version", "3"),
        ("version", True),
        ("kind", "anchor+delta"),
        ("delta_path", None),  # a delta without its file
        ("anchor_path", "runs/run-a/anchors/x.safetensors"),  # an anchor path on a delta
        ("delta_bytes", -1),
        ("delta_bytes", 1.5),
        ("total_elements", 10),  # fewer than changed
        ("sparsity", 1.5),
        ("sparsity", "0.9"),
        ("encode_s", -0.1),
        ("committed_at", None),
        ("step", -1),
        ("step", 2.0),
        ("reward_mean", "high"),
        ("sync_s", -1),
        ("replicas", []),
        ("replicas", {"r0": {"ok": True}}),
        ("replicas", {"r0": _outcome(ok=1)}),
        ("replicas", {"r0": _outcome(attempts=0)}),
        ("replicas", {"r0": _outcome(apply_s=0.1)}),
    ],
)
def test_bad_field_is_refused(key, value):
    raw = _raw(_record()) | {key: value}
    with pytest.raises(FormatError, match=f"metrics.*{key}"):
        SyncRecord.from_json(json.dumps(raw).encode(), path="m.json")


@pytest.mark.parametrize(
    "data",
    [b"", b"[]", b"{", b"\xff\xfe", b'{"version": NaN}', b"[" * 100_000 + b"]" * 100_000],
)
def test_not_a_record(data):
    with pytest.raises(FormatError):
        SyncRecord.from_json(data)


def test_size_is_bounded():
    padded = _raw(_record())
    padded["encoding"] = "x" * MAX_RECORD_BYTES
    with pytest.raises(FormatError, match="exceeds"):
        SyncRecord.from_json(json.dumps(padded).encode())
    huge_error = ReplicaOutcome("r0", False, 1, error="e" * 10_000)
    assert len(huge_error.error) == 2000  # long messages are cut, not refused


def test_nan_reward_becomes_null():
    """TRL logs NaN when no sample of the step had a reward; JSON has no NaN."""
    record = _record().with_sync((), sync_s=0.1, step=4, reward_mean=float("nan"))
    assert record.reward_mean is None and _raw(record)["reward_mean"] is None


def test_construction_validates_before_anything_is_written():
    with pytest.raises(FormatError, match="kind"):
        _record(kind="both")
    with pytest.raises(FormatError, match="distinct names"):
        _record().with_sync(
            (ReplicaOutcome("r", True, 1), ReplicaOutcome("r", True, 1)),
            sync_s=0.1,
            step=1,
            reward_mean=None,
        )


def test_anchor_and_delta_plus_anchor_kinds():
    anchor = _record(
        version=1,
        kind="anchor",
        delta_path=None,
        anchor_path="runs/run-a/anchors/00000001-0123456789ab.safetensors",
        delta_bytes=0,
        anchor_bytes=200_000,
    )
    assert anchor.has_anchor and not anchor.has_delta
    both = _record(kind="delta+anchor", anchor_path=anchor.anchor_path, anchor_bytes=200_000)
    assert both.has_anchor and both.has_delta
    assert SyncRecord.from_json(both.to_json()) == both


def test_publisher_and_its_re_export_share_the_class():
    from deltasync.publisher.publisher import PublisherConfig
    from deltasync.publisher.publisher import SyncRecord as FromPublisher

    assert FromPublisher is SyncRecord
    assert PublisherConfig(run_id="r").write_metrics is True


def test_publisher_writes_one_record_per_version_or_none(tmp_path):
    """`write_metrics=False` leaves the record to the caller: exactly one writer."""
    import torch

    from deltasync.publisher.publisher import Publisher, PublisherConfig
    from deltasync.store import LocalStore
    from deltasync.wire.manifest import metrics_path

    model = torch.nn.Linear(8, 8)
    for write, folder in ((True, "on"), (False, "off")):
        store = LocalStore(str(tmp_path / folder))
        config = PublisherConfig(run_id="run-a", write_metrics=write)
        with Publisher(store, config) as publisher:
            record = publisher.publish(model).result(timeout=60)
        written = store.list("runs/run-a/metrics")
        if write:
            assert written == [metrics_path("run-a", 1)]
            assert SyncRecord.from_json(store.get(written[0])) == record
        else:
            assert written == []


def test_module_imports_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numba'] = None\n"
        "import deltasync.wire.metrics\n"
        "assert not any(m.startswith(('torch', 'numba')) for m in sys.modules if sys.modules[m])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
