"""The bucket reader behind the dashboard: series, incremental reads, broken and partial buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltasync.errors import StoreError
from deltasync.store import LocalStore
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, metrics_path
from deltasync.wire.metrics import MAX_RECORD_BYTES, ReplicaOutcome, SyncRecord
from spaces.dashboard import charts
from spaces.dashboard.data import BucketWatcher, WatcherConfig
from spaces.dashboard.series import (
    files_table,
    health_markdown,
    series_json,
    status_markdown,
    timing_series,
    version_series,
)

from .conftest import CountingStore, Trainer


def watch(store, **config) -> BucketWatcher:
    return BucketWatcher(store, WatcherConfig(min_poll_s=0.0, **config))


def bucket_dir(trainer: Trainer) -> Path:
    return Path(trainer.store.root)


def test_series_match_publisher_records(trainer):
    records = trainer.publish(10)
    snap = watch(trainer.store).snapshot()
    assert snap.state == "ok", snap.message
    rows = {r["version"]: r for r in version_series(snap)}
    assert sorted(rows) == list(range(1, 11))
    for rec in records:
        row = rows[rec.version]
        assert row["kind"] == rec.kind
        assert row["full_bytes"] == rec.full_bytes
        assert row["anchor_bytes"] == (rec.anchor_bytes or None)
        if "delta" in rec.kind:
            assert row["delta_bytes"] == rec.delta_bytes
            assert row["changed_elements"] == rec.changed_elements
            assert row["sparsity"] == pytest.approx(rec.sparsity, abs=1e-6)
        else:
            assert row["sparsity"] is None
    anchors = [r.version for r in records if "anchor" in r.kind]
    assert anchors == [1, 5, 9]  # AnchorPolicy(interval=4)


def test_health_is_the_replay_cost_of_a_new_replica(trainer):
    trainer.publish(7)
    manifest = trainer.manifest()
    snap = watch(trainer.store).snapshot()
    anchor = manifest.latest_anchor
    after = manifest.deltas_after(anchor.version)
    assert snap.health is not None
    assert snap.health.latest_version == 7
    assert snap.health.latest_anchor == anchor.version == 5
    assert snap.health.replay_bytes == anchor.bytes + sum(d.bytes for d in after)
    assert snap.health.replay_files == 1 + len(after)
    assert "replay cost for a new replica" in health_markdown(snap)
    table = files_table(snap)
    assert [row[0] for row in table] == sorted((row[0] for row in table), reverse=True)
    assert {row[-1] for row in table} == {"ok"}


def test_refresh_reads_only_new_headers(trainer):
    trainer.publish(5)
    store = CountingStore(bucket_dir(trainer))
    watcher = watch(store)
    first = watcher.snapshot()
    calls = store.take()
    sizes = {e.path: e.bytes for e in (*trainer.manifest().anchors, *trainer.manifest().deltas)}
    header_bytes = {f.entry.path: f.header.header_bytes for f in first.files if f.header}
    assert set(header_bytes) == set(sizes)
    _assert_header_reads_only(calls, header_bytes, sizes)

    old_paths = set(sizes)
    trainer.publish(3)
    manifest = trainer.manifest()
    new_paths = {e.path for e in (*manifest.anchors, *manifest.deltas)} - old_paths
    second = watcher.snapshot()
    calls = store.take()
    header_bytes = {f.entry.path: f.header.header_bytes for f in second.files if f.header}
    sizes = {e.path: e.bytes for e in (*manifest.anchors, *manifest.deltas)}
    assert {p for op, p, _ in calls if op == "get_range"} == new_paths
    _assert_header_reads_only(calls, {p: header_bytes[p] for p in new_paths}, sizes)
    gets = sorted(p for op, p, _ in calls if op == "get")
    assert gets == sorted([MANIFEST_PATH] + [metrics_path("run-a", v) for v in (6, 7, 8)])
    assert [r["version"] for r in version_series(second)] == list(range(1, 9))

    watcher.snapshot()  # nothing new: the manifest is the only content read
    calls = store.take()
    assert [(op, p) for op, p, _ in calls if op != "list"] == [("get", MANIFEST_PATH)]


def _assert_header_reads_only(calls, header_bytes: dict[str, int], sizes: dict[str, int]) -> None:
    """Every safetensors read is a byte range, and exactly the header of each file is read."""
    read: dict[str, int] = {}
    for op, path, n in calls:
        if path.endswith(".safetensors"):
            assert op == "get_range", f"{op} of {path}: only byte ranges may touch files"
            read[path] = read.get(path, 0) + n
    assert read == header_bytes
    assert all(read[p] < sizes[p] for p in read)


def test_empty_bucket(tmp_path):
    snap = watch(LocalStore(str(tmp_path / "empty"))).snapshot()
    assert snap.state == "empty"
    assert "no `manifest.json` yet" in snap.message
    assert version_series(snap) == [] and files_table(snap) == []
    assert "nothing committed" in health_markdown(snap)
    spec = charts.payload_chart(version_series(snap))
    assert spec["layer"][0]["mark"]["type"] == "text"
    assert json.loads(charts.to_plot(spec).plot) == spec


def test_files_arriving_before_the_first_manifest(trainer):
    trainer.publish(2)
    (bucket_dir(trainer) / MANIFEST_PATH).unlink()
    snap = watch(trainer.store).snapshot()
    assert snap.state == "waiting"
    assert "no `manifest.json` yet" in snap.message


def test_manifest_names_a_file_not_listed_yet(trainer):
    trainer.publish(6)
    newest = max(trainer.manifest().deltas, key=lambda d: d.version)
    file = bucket_dir(trainer) / newest.path
    hidden = file.with_name("hidden")
    file.rename(hidden)
    watcher = watch(trainer.store)
    snap = watcher.snapshot()
    row = next(f for f in snap.files if f.entry.path == newest.path)
    assert row.status == "pending" and "not listed" in row.detail
    assert any("pending" in p for p in snap.problems)
    assert "pending" in files_table(snap)[0][-1]

    hidden.rename(file)  # the upload lands: the next refresh reads it (pending is not cached)
    row = next(f for f in watcher.snapshot().files if f.entry.path == newest.path)
    assert row.status == "ok" and row.header is not None


def test_metrics_record_missing(trainer):
    trainer.publish(4)
    (bucket_dir(trainer) / metrics_path("run-a", 4)).unlink()
    snap = watch(trainer.store).snapshot()
    assert snap.state == "ok"
    assert "metrics for version 4 not written yet" in snap.problems
    row = version_series(snap)[-1]
    assert row["version"] == 4 and row["source"] == "header" and row["sparsity"] is not None


def test_corrupt_file_is_marked_and_not_reread(trainer):
    trainer.publish(6)
    manifest = trainer.manifest()
    garbage, truncated = manifest.deltas[-1], manifest.deltas[-2]
    path = bucket_dir(trainer) / garbage.path
    path.write_bytes(b"\xff" * garbage.bytes)
    path = bucket_dir(trainer) / truncated.path
    path.write_bytes(path.read_bytes()[:-10])
    store = CountingStore(bucket_dir(trainer))
    watcher = watch(store)
    snap = watcher.snapshot()
    assert snap.state == "error" and "2 file(s) marked" in snap.message
    rows = {f.entry.path: f for f in snap.files}
    assert rows[garbage.path].status == "corrupt" and "header size" in rows[garbage.path].detail
    assert rows[truncated.path].status == "corrupt"
    assert "manifest says" in rows[truncated.path].detail
    assert sum(f.status == "ok" for f in snap.files) == len(snap.files) - 2
    assert "corrupt" in status_markdown(snap)
    store.take()
    watcher.snapshot()
    assert not [c for c in store.take() if c[0] == "get_range"]  # files are immutable


def test_corrupt_metrics_record(trainer):
    trainer.publish(4)
    (bucket_dir(trainer) / metrics_path("run-a", 3)).write_bytes(b"{not json")
    snap = watch(trainer.store).snapshot()
    assert any("corrupt metrics record" in p and "00000003.json" in p for p in snap.problems)
    assert [r.version for r in snap.records] == [1, 2, 4]
    assert 3 in {r["version"] for r in version_series(snap)}  # its delta header still counts


def test_an_oversized_metrics_record_is_read_bounded_and_refused_once(trainer):
    """A 3 MB record (the limit is 1 MiB): at most limit + 1 bytes are read, it is reported
    like a corrupt record, and later polls do not read it again (records are immutable)."""
    trainer.publish(4)
    (bucket_dir(trainer) / metrics_path("run-a", 3)).write_bytes(b" " * 3_000_000)

    reads: list[tuple[str, int | None]] = []

    class SpyStore(LocalStore):
        def _read(self, full: str, end: int | None) -> bytes:
            reads.append((full.rsplit("/", 1)[-1], end))
            return super()._read(full, end)

    store = SpyStore(bucket_dir(trainer))
    watcher = watch(store)
    snap = watcher.snapshot()
    assert any("00000003.json" in p and "larger than" in p for p in snap.problems)
    assert [r.version for r in snap.records] == [1, 2, 4]
    assert ("00000003.json", MAX_RECORD_BYTES + 1) in reads
    reads.clear()
    watcher._cache.manifest_bytes = None  # force a full poll
    watcher.snapshot()
    assert not [r for r in reads if r[0] == "00000003.json"]


def test_corrupt_manifest_then_repaired(trainer):
    trainer.publish(3)
    manifest = bucket_dir(trainer) / MANIFEST_PATH
    good = manifest.read_bytes()
    manifest.write_bytes(b"garbage")
    watcher = watch(trainer.store)
    snap = watcher.snapshot()
    assert snap.state == "error" and "`manifest.json` is unreadable" in snap.message
    manifest.write_bytes(good)
    assert watcher.snapshot().state == "ok"


class FailingStore(LocalStore):
    fail = False

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        if self.fail:
            raise StoreError("connection reset", path=path)
        return super().get(path, limit=limit)


def test_unreachable_bucket_keeps_the_last_data(trainer):
    trainer.publish(3)
    store = FailingStore(str(bucket_dir(trainer)))
    watcher = watch(store)
    good = watcher.snapshot()
    store.fail = True
    snap = watcher.snapshot()
    assert snap.state == "error" and "showing data from" in snap.message
    assert snap.files == good.files and snap.records == good.records
    store.fail = False
    assert watcher.snapshot().state == "ok"


def test_reads_per_refresh_are_bounded(trainer):
    trainer.publish(6)
    watcher = watch(trainer.store, max_reads=3)
    snap = watcher.snapshot()
    assert any("continuing next refresh" in p for p in snap.problems)
    assert sum(f.header is not None for f in snap.files) + len(snap.records) == 3
    for _ in range(10):
        snap = watcher.snapshot()
        if not any("continuing" in p for p in snap.problems):
            break
    assert all(f.status == "ok" for f in snap.files) and len(snap.records) == 6


def test_records_are_read_with_exact_keys(trainer):
    """A record with a key the schema does not have is corrupt, not half-read."""
    trainer.publish(3)
    path = metrics_path("run-a", 2)
    raw = json.loads(trainer.store.get(path)) | {"reward": 0.5}
    trainer.store.put(path, json.dumps(raw).encode())
    snap = watch(trainer.store).snapshot()
    assert [r.version for r in snap.records] == [1, 3]
    problem = next(p for p in snap.problems if "corrupt metrics record" in p)
    assert "unknown keys ['reward']" in problem and "00000002.json" in problem


def test_timings_from_replicas_or_trainer(trainer):
    trainer.publish(3)
    watcher = watch(trainer.store)
    rows, from_replicas = timing_series(watcher.snapshot())
    assert not from_replicas and {r["series"] for r in rows} == {"trainer encode", "trainer upload"}
    title = charts.timing_chart(rows, from_replicas)["title"]
    assert "replicas have not reported" in title

    trainer.complete(3, {"vllm-0": (0.4, 0.03)}, reward=0.5)
    data = series_json(watch(trainer.store).snapshot())  # records are immutable: a new reader
    assert data["timings_from_replicas"] is True
    seconds = {r["series"]: r["seconds"] for r in data["timings"]}
    assert seconds == pytest.approx(
        {"vllm-0 stage": 0.4, "vllm-0 pause": 0.03, "vllm-0 total": 0.44}
    )
    assert data["reward"] == [{"step": 2, "version": 3, "reward": 0.5}]


def test_a_lagging_replica_at_the_newest_version_is_a_problem(trainer):
    trainer.publish(2)
    path = metrics_path("run-a", 2)
    record = SyncRecord.from_json(trainer.store.get(path)).with_sync(
        (ReplicaOutcome("vllm-1", False, 2, total_s=4.0, error="connection refused"),),
        sync_s=4.0,
        step=1,
        reward_mean=None,
    )
    trainer.store.put(path, record.to_json())
    snap = watch(trainer.store).snapshot()
    assert (
        "version 2: replica vllm-1 did not sync after 2 attempt(s): connection refused"
        in snap.problems
    )
    _, from_replicas = timing_series(snap)  # a failed sync has no stage or pause to chart
    assert not from_replicas


def test_payload_chart_is_log_scale_with_anchors_marked(trainer):
    trainer.publish(6)
    versions = version_series(watch(trainer.store).snapshot())
    spec = charts.payload_chart(versions)
    scales = [layer["encoding"].get("y", {}).get("scale") for layer in spec["layer"]]
    assert {"type": "log"} in scales
    anchors = {p["version"] for p in spec["data"]["values"] if p["file"] == "anchor"}
    assert anchors == {1, 5}
    full = spec["layer"][-1]["data"]["values"][0]
    assert full == {"bytes": versions[0]["full_bytes"], "file": "full bf16 model"}


def test_sharded_versions_are_read_part_by_part(tmp_path):
    """A sharded version's parts are each read by their headers and added up."""
    from sharded_bucket import write_sharded_bucket

    states = write_sharded_bucket(tmp_path, versions=4)
    snap = watch(LocalStore(str(tmp_path))).snapshot()
    assert snap.state in ("ok", "partial"), snap.message
    rows = {r["version"]: r for r in version_series(snap)}
    assert sorted(rows) == [1, 2, 3, 4]
    total = sum(t.numel() for t in states[0].values())
    old, new = states[2], states[3]
    changed = sum(int((old[n].view(-1) != new[n].view(-1)).sum()) for n in old)
    assert rows[4]["changed_elements"] == changed
    assert rows[4]["sparsity"] == pytest.approx(1 - changed / total, abs=1e-6)
    assert all(row[-1] == "ok" for row in files_table(snap))  # every part's header checked
    assert all(file.header is not None for file in snap.files)


def test_a_virtual_first_anchor_costs_the_model_bytes_to_replay(tmp_path):
    """Version 1 names a checkpoint folder: its file is a header, but a new replica reads the
    whole model from that checkpoint, and the health line says so."""
    import safetensors.torch

    from deltasync import Publisher, PublisherConfig
    from deltasync.publisher.snapshot import Bf16Snapshot
    from deltasync.wire.source import ModelSource

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    safetensors.torch.save_file(
        dict(Bf16Snapshot.capture(model).tensors), folder / "model.safetensors"
    )
    store = LocalStore(tmp_path / "bucket")
    source = ModelSource("folder", str(folder))
    with Publisher(store, PublisherConfig(run_id="run-v", source=source)) as publisher:
        publisher.publish(model).result(timeout=60)
        with torch.no_grad():
            model.weight[0, :5] += 1.0
        publisher.publish(model).result(timeout=60)
    snap = watch(store).snapshot()
    (anchor,) = Manifest.from_json(store.get(MANIFEST_PATH)).anchors
    assert anchor.encoding == "virtual" and anchor.bytes < 4000
    model_bytes = 2 * sum(p.numel() for p in model.parameters())
    delta = Manifest.from_json(store.get(MANIFEST_PATH)).deltas[0]
    assert snap.health.replay_bytes == model_bytes + delta.bytes
    assert {row[-1] for row in files_table(snap)} == {"ok"}


HOSTILE_TEXT = "![beacon](http://evil.test/b.png) [click](http://evil.test) <img src=x> `x` **"


def test_bucket_text_is_shown_as_plain_text(trainer):
    """A bucket writer's strings reach the status line (here through a manifest error) as
    themselves: no image, link, HTML or code span on the public page."""
    from markdown_it import MarkdownIt

    trainer.publish(1)
    manifest = bucket_dir(trainer) / MANIFEST_PATH
    manifest.write_text(json.dumps({"protocol": HOSTILE_TEXT}))
    snap = watch(trainer.store).snapshot()
    assert snap.state == "error" and HOSTILE_TEXT in snap.message
    html = MarkdownIt("commonmark").render(status_markdown(snap))
    assert not any(tag in html for tag in ("<img", "<a ", "<code", "<em", "<strong>x"))
    shown = html.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    assert HOSTILE_TEXT in shown
