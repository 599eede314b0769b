"""Buckets written by the real publisher, a store that counts reads, a dashboard on loopback."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from the tests

from server_process import free_port

from deltasync import AnchorPolicy, Publisher, PublisherConfig, SyncRecord
from deltasync.store import LocalStore
from deltasync.wire.manifest import MANIFEST_PATH, Manifest, metrics_path
from deltasync.wire.metrics import ReplicaOutcome

PUBLISH_TIMEOUT_S = 60.0


class Trainer:
    """A small MLP trained with AdamW (lr 1e-5) that publishes each step to a folder bucket."""

    def __init__(self, store: LocalStore, *, run_id: str = "run-a", interval: int = 4):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.publisher = Publisher(
            store,
            PublisherConfig(run_id=run_id, policy=AnchorPolicy(interval=interval)),
        )
        self.store = store
        self.records: list[SyncRecord] = []

    def step(self) -> None:
        x = torch.randn(32, 128, generator=self.generator)
        loss = torch.nn.functional.mse_loss(self.model(x), x.flip(1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self, versions: int) -> list[SyncRecord]:
        """Train and publish `versions` versions (the first one of a run is the initial model)."""
        futures = []
        for _ in range(versions):
            if self.records or futures:
                self.step()
            futures.append(self.publisher.publish(self.model))
        new = [f.result(timeout=PUBLISH_TIMEOUT_S) for f in futures]
        self.publisher.flush(PUBLISH_TIMEOUT_S)
        self.records.extend(new)
        return new

    def complete(
        self, version: int, replicas: dict[str, tuple[float, float]], reward: float | None
    ) -> SyncRecord:
        """Rewrite a version's record as the trainer's weight transfer writes it: replicas'
        (stage_s, pause_s) and latency, the step that produced the version (version - 1), its
        reward."""
        path = metrics_path(self.publisher.config.run_id, version)
        outcomes = tuple(
            ReplicaOutcome(
                name,
                True,
                1,
                stage,
                pause,
                stage + pause + 0.01,
                latency_s=stage + pause + 0.2,
                served_version=version,
            )
            for name, (stage, pause) in replicas.items()
        )
        record = SyncRecord.from_json(self.store.get(path)).with_sync(
            outcomes, sync_s=0.5, step=version - 1, reward_mean=reward
        )
        self.store.put(path, record.to_json())
        return record

    def manifest(self) -> Manifest:
        return Manifest.from_json(self.store.get(MANIFEST_PATH))

    def close(self) -> None:
        self.publisher.close(PUBLISH_TIMEOUT_S)


class CountingStore(LocalStore):
    """A folder bucket that records every read: (operation, path, bytes returned)."""

    def __init__(self, folder: str | Path):
        super().__init__(str(folder))
        self.calls: list[tuple[str, str, int]] = []

    def get(self, path: str, *, limit: int | None = None) -> bytes:
        data = super().get(path, limit=limit)
        self.calls.append(("get", path, len(data)))
        return data

    def get_range(self, path: str, start: int, end: int) -> bytes:
        data = super().get_range(path, start, end)
        self.calls.append(("get_range", path, len(data)))
        return data

    def list(self, prefix: str = "") -> list[str]:
        self.calls.append(("list", prefix, 0))
        return super().list(prefix)

    def take(self) -> list[tuple[str, str, int]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    t = Trainer(LocalStore(str(tmp_path / "bucket")))
    yield t
    t.close()


@pytest.fixture
def launch() -> Iterator[Callable[..., str]]:
    """Start dashboards on free loopback ports; returns their URLs; closes them afterwards."""
    from spaces.dashboard.app import DashboardConfig, build_dashboard
    from spaces.dashboard.data import WatcherConfig
    from spaces.dashboard.serving import launch as serve

    demos = []

    def _launch(bucket: object, *, refresh_s: float = 60.0) -> str:
        config = DashboardConfig(refresh_s=refresh_s, watcher=WatcherConfig(min_poll_s=0.0))
        demo = build_dashboard(bucket, config)  # type: ignore[arg-type]
        port = free_port()
        serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
        demos.append(demo)
        return f"http://127.0.0.1:{port}/"

    yield _launch
    for demo in demos:
        demo.close()
