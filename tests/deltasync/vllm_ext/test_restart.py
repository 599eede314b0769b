"""A replica killed in the middle of an update (SIGKILL to its whole process group just as
the sync request is sent) comes back on the same port, catches up from the bucket and serves
the trainer's latest bf16 weights bitwise; the bucket is never written by a replica. A killed
launcher takes its vLLM server down with it."""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading

import psutil
import pytest
from model_steps import AdamWLoop
from server_process import still_running

from bench.server import free_port, served
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient, ReplicaError
from deltasync.vllm_ext.protocol import SYNC_PATH
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

pytestmark = pytest.mark.slow
TOKEN = f"test-{secrets.token_hex(16)}"


def kill_all(processes: list[psutil.Process]) -> None:
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)


class KillingClient(ReplicaClient):
    """SIGKILLs the launcher, vLLM and its engine right after dispatching the sync request."""

    def __init__(self, base: ReplicaClient, launcher: psutil.Process):
        super().__init__(base.base_url, base.token, timeout_s=60)
        self.processes = [launcher, *launcher.children(recursive=True)]

    def request(self, method, path, body=None, *, query=None):
        if path == SYNC_PATH:
            threading.Timer(0.001, kill_all, (self.processes,)).start()
        return super().request(method, path, body, query=query)


def _bucket_files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_killed_mid_update_restarts_and_catches_up_bitwise(tmp_path):
    model = build_tiny_qwen3(tmp_path / "model", init_std=0.02)
    loop = AdamWLoop(model, lr=1e-4)
    bucket = tmp_path / "bucket"
    policy = AnchorPolicy(interval=100, max_delta_fraction=None)
    publisher = Publisher(open_store(str(bucket)), PublisherConfig("restart", policy=policy))
    port = free_port()
    try:
        publisher.publish(model).result(timeout=60)
        with served(tmp_path / "model", bucket, tmp_path / "a.log", token=TOKEN, port=port) as (
            client,
            proc,
        ):
            assert client.weight_version() == "1"
            for _ in range(3):
                loop.step()
                record = publisher.publish(model).result(timeout=60)
            before = _bucket_files(bucket)
            killer = KillingClient(client, proc)
            assert len(killer.processes) >= 3  # launcher, vLLM API server, engine core
            with pytest.raises(ReplicaError):
                killer.sync_to(record.version, record.delta_path)
            assert not still_running(killer.processes, timeout_s=30)
        assert _bucket_files(bucket) == before  # a dying replica changes nothing in the bucket
        loop.step()
        latest = publisher.publish(model).result(timeout=60)
        expected = Bf16Snapshot.capture(model).digests()
        with served(tmp_path / "model", bucket, tmp_path / "b.log", token=TOKEN, port=port) as (
            client,
            launcher,
        ):
            report = client.digests()
            assert report["version"] == latest.version == 5
            assert report["digests"] == expected
            assert client.weight_version() == "5"
            assert len(client.complete_tokens(str(tmp_path / "model"), [1, 2, 3], 4)[0]) == 4
            children = launcher.children(recursive=True)
            launcher.send_signal(signal.SIGKILL)  # only the launcher: vLLM must not outlive it
            alive = still_running(children, timeout_s=60)
            assert not alive, alive
    finally:
        publisher.close()
