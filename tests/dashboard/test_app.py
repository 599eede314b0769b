"""The launched app on loopback, driven through gradio_client as a browser's timer would."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import requests
from gradio_client import Client

from deltasync.store import LocalStore
from deltasync.wire.manifest import MANIFEST_PATH, metrics_path
from spaces.dashboard.app import main

from .conftest import CountingStore, Trainer

# Gradio 6.31's own per-event analytics table (queueing.py) trips pandas 3 deprecations.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]
OUTPUTS = ["status", "health", "sparsity", "payload", "timing", "reward", "latency", "table"]


def refresh(client: Client) -> dict:
    values = client.predict(api_name="/refresh")
    assert len(values) == len(OUTPUTS)
    out = dict(zip(OUTPUTS, values, strict=True))
    for name in ("sparsity", "payload", "timing", "reward", "latency"):
        assert out[name]["type"] == "altair"
        out[name] = json.loads(out[name]["plot"])
    return out


def test_series_endpoint_returns_the_published_series(trainer, launch):
    records = trainer.publish(9)
    client = Client(launch(trainer.store.root), verbose=False)
    data = client.predict(api_name="/series")
    assert data["state"] == "ok", data["message"]
    by_version = {r["version"]: r for r in data["versions"]}
    assert sorted(by_version) == [r.version for r in records]
    for rec in records:
        row = by_version[rec.version]
        assert row["kind"] == rec.kind
        if "delta" in rec.kind:
            assert (row["delta_bytes"], row["changed_elements"]) == (
                rec.delta_bytes,
                rec.changed_elements,
            )
            assert row["sparsity"] == pytest.approx(rec.sparsity, abs=1e-6)
        assert row["anchor_bytes"] == (rec.anchor_bytes or None)
    manifest = trainer.manifest()
    anchor = manifest.latest_anchor
    assert data["health"]["latest_version"] == 9
    assert data["health"]["latest_anchor"] == anchor.version
    assert data["health"]["replay_bytes"] == anchor.bytes + sum(
        d.bytes for d in manifest.deltas_after(anchor.version)
    )
    assert {f["name"] for f in data["files"]} == manifest.referenced_paths()
    assert {(t["version"], t["series"]) for t in data["timings"]} == {
        (r.version, s) for r in records for s in ("trainer encode", "trainer upload")
    }
    assert data["reward"] == []


def test_refresh_endpoint_returns_every_component(trainer, launch):
    records = trainer.publish(6)
    out = refresh(Client(launch(trainer.store.root), verbose=False))
    assert "**OK**" in out["status"] and "version 6" in out["status"]
    assert "replay cost for a new replica" in out["health"]
    deltas = [r for r in records if "delta" in r.kind]
    sparsity = {v["version"]: v["sparsity"] for v in out["sparsity"]["data"]["values"]}
    assert sparsity == pytest.approx({r.version: r.sparsity for r in deltas}, abs=1e-6)
    payload = out["payload"]["data"]["values"]
    assert {p["version"] for p in payload if p["file"] == "anchor"} == {1, 5}
    assert any(
        layer["encoding"].get("y", {}).get("scale") == {"type": "log"}
        for layer in out["payload"]["layer"]
    )
    assert out["reward"]["layer"][0]["mark"]["type"] == "text"  # no reward in these metrics
    table = out["table"]
    assert table["headers"][:3] == ["version", "kind", "encoding"]
    assert table["data"][0][:2] == [6, "delta"]


def test_refresh_after_new_versions_reads_only_new_headers(trainer, launch):
    trainer.publish(4)
    store = CountingStore(trainer.store.root)
    client = Client(launch(store), verbose=False)
    assert client.predict(api_name="/series")["health"]["latest_version"] == 4
    before = trainer.manifest().referenced_paths()
    store.take()

    trainer.publish(3)
    data = client.predict(api_name="/series")
    calls = store.take()
    assert data["health"]["latest_version"] == 7
    new = trainer.manifest().referenced_paths() - before
    ranges = {p for op, p, _ in calls if op == "get_range"}
    assert ranges == new
    assert not [p for op, p, _ in calls if op == "get" and p.endswith(".safetensors")]
    gets = sorted(p for op, p, _ in calls if op == "get")
    assert gets == sorted([MANIFEST_PATH] + [metrics_path("run-a", v) for v in (5, 6, 7)])
    read = {p: sum(n for op, q, n in calls if q == p) for p in ranges}
    headers = {f["name"]: f["bytes"] for f in data["files"]}
    assert all(read[p] < headers[p] for p in ranges)  # headers only, never whole files


def test_app_survives_an_empty_then_filling_bucket(tmp_path, launch):
    folder = tmp_path / "bucket"
    client = Client(launch(str(folder)), verbose=False)
    out = refresh(client)
    assert "**EMPTY**" in out["status"]
    assert out["payload"]["layer"][0]["mark"]["type"] == "text"
    assert out["table"]["data"] in ([], [["", "", "", "", "", "", ""]])

    trainer = Trainer(LocalStore(str(folder)))
    try:
        trainer.publish(3)
    finally:
        trainer.close()
    (folder / trainer.manifest().deltas[-1].path).write_bytes(b"\x00" * 16)
    out = refresh(client)
    shown = re.sub(r"\\(.)", r"\1", out["status"])  # bucket text is backslash-escaped
    assert "**ERROR**" in shown and "1 file(s) marked" in shown
    statuses = [row[-1] for row in out["table"]["data"]]
    assert statuses[0].startswith("⚠ corrupt") and statuses[1:] == ["ok"] * (len(statuses) - 1)


def test_cli_needs_a_bucket(monkeypatch, capsys):
    monkeypatch.delenv("DELTASYNC_BUCKET", raising=False)
    assert main([]) == 2
    assert "pass --bucket or set DELTASYNC_BUCKET" in capsys.readouterr().err
    assert main(["--bucket", "hf://models/x"]) == 2
    assert "not a bucket URL" in capsys.readouterr().err


@pytest.mark.parametrize("size", [0, 1, 1_000_000])
def test_the_dashboard_takes_no_uploads(trainer, launch, size):
    """Gradio's upload route (open on every Gradio app) answers 403 before a byte is stored,
    whatever the size, under the API prefix or not; the dashboard still serves."""
    trainer.publish(2)
    url = launch(trainer.store)
    upload_dir = Path(tempfile.gettempdir(), "gradio")
    before = set(upload_dir.rglob("*")) if upload_dir.exists() else set()
    for route in ("gradio_api/upload", "gradio_api/upload/", "upload"):
        answer = requests.post(url + route, files={"files": ("x.txt", b"x" * size)}, timeout=30)
        assert answer.status_code == 403, (route, answer.status_code)
    after = set(upload_dir.rglob("*")) if upload_dir.exists() else set()
    assert after == before
    assert "version 2" in refresh(Client(url, verbose=False))["status"]
