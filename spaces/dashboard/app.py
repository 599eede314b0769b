"""Gradio dashboard for a deltasync bucket: sparsity, payload, sync pauses, commit-to-serving
latency, reward, chain health.

Run it (the bucket may be a folder, hf://buckets/NS/NAME or any fsspec URL such as s3://b/p):

    python -m spaces.dashboard.app --bucket ./bucket --host 127.0.0.1 --port 7860
    DELTASYNC_BUCKET=hf://buckets/me/rl-weights python -m spaces.dashboard.app

It reads only `manifest.json`, the metrics records and safetensors headers (byte ranges), and
each refresh fetches only files it has not seen (see data.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from deltasync import settings
from deltasync.defaults import DASHBOARD_PORT
from deltasync.errors import DeltaSyncError
from deltasync.store import Store, open_store

from . import charts
from .data import BucketWatcher, Snapshot, WatcherConfig
from .replicas import ReplicaPoller, ReplicaStatus, parse_replica_urls
from .series import (
    REPLICA_COLUMNS,
    TABLE_COLUMNS,
    files_table,
    health_markdown,
    latency_series,
    replicas_table,
    reward_series,
    series_json,
    status_markdown,
    timing_series,
    version_series,
)
from .serving import launch

__all__ = ["DashboardConfig", "build_dashboard", "main"]


@dataclass(frozen=True)
class DashboardConfig:
    """UI settings; bounds on reading the bucket live in `watcher`."""

    refresh_s: float = 5.0
    table_rows: int = 20
    watcher: WatcherConfig = field(default_factory=WatcherConfig)
    replicas: tuple[str, ...] = ()  # rollout servers whose open /health to show


def build_dashboard(bucket: str | Store, config: DashboardConfig | None = None) -> gr.Blocks:
    """The dashboard for one bucket (a URL, or an open `Store`, e.g. a wrapped one in tests).

    API endpoints: `/refresh` (every component's value, as the timer gets them) and `/series`
    (the same data as plain JSON).
    """
    config = config or DashboardConfig()
    store = open_store(bucket) if isinstance(bucket, str) else bucket
    watcher = BucketWatcher(store, config.watcher)
    poller = ReplicaPoller(config.replicas)

    def replica_statuses(snap: Snapshot) -> list[ReplicaStatus]:
        health = snap.health
        if health is None:
            return poller.statuses(None)
        return poller.statuses(health.latest_version, max(0.0, time.time() - health.updated_at))

    def refresh() -> tuple[Any, ...]:
        snap = watcher.snapshot()
        versions = version_series(snap)
        timings, from_replicas = timing_series(snap)
        shown = (
            status_markdown(snap),
            health_markdown(snap),
            charts.to_plot(charts.sparsity_chart(versions)),
            charts.to_plot(charts.payload_chart(versions)),
            charts.to_plot(charts.timing_chart(timings, from_replicas)),
            charts.to_plot(charts.reward_chart(reward_series(snap))),
            charts.to_plot(charts.latency_chart(latency_series(snap))),
            files_table(snap, config.table_rows),
        )
        if not config.replicas:
            return shown
        return (*shown, replicas_table(replica_statuses(snap)))

    def series() -> dict[str, Any]:
        """Every series the charts show, the files, the chain's health and the replicas."""
        snap = watcher.snapshot()
        return series_json(snap) | {"replicas": [r.to_json() for r in replica_statuses(snap)]}

    with gr.Blocks(title="deltasync dashboard") as demo:
        gr.Markdown("## deltasync bucket dashboard")
        status = gr.Markdown(elem_id="status")
        health = gr.Markdown(elem_id="health")
        with gr.Row():
            sparsity = gr.Plot(label="sparsity", show_label=False, elem_id="sparsity-chart")
            payload = gr.Plot(label="payload", show_label=False, elem_id="payload-chart")
        with gr.Row():
            timing = gr.Plot(label="sync timings", show_label=False, elem_id="timing-chart")
            reward = gr.Plot(label="reward", show_label=False, elem_id="reward-chart")
        with gr.Row():
            latency = gr.Plot(label="latency", show_label=False, elem_id="latency-chart")
        table = gr.Dataframe(
            headers=TABLE_COLUMNS,
            label=f"Latest files (newest {config.table_rows})",
            interactive=False,
            elem_id="files-table",
        )
        outputs = [status, health, sparsity, payload, timing, reward, latency, table]
        if config.replicas:
            outputs.append(
                gr.Dataframe(
                    headers=REPLICA_COLUMNS,
                    label="Replicas (their open /health)",
                    interactive=False,
                    elem_id="replicas-table",
                )
            )
        timer = gr.Timer(config.refresh_s)
        timer.tick(refresh, outputs=outputs, api_name="refresh", show_progress="hidden")
        demo.load(refresh, outputs=outputs, api_visibility="private", show_progress="hidden")
        gr.api(series, api_name="series")
    return demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spaces.dashboard.app",
        description="Chart a deltasync bucket: sparsity, payload, sync pauses, latency, chain "
        "health.",
    )
    parser.add_argument(
        "--bucket",
        default=settings.BUCKET.read() or None,
        help=f"folder, hf://buckets/NS/NAME or fsspec URL (default: ${settings.BUCKET.name})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 inside a Space")
    parser.add_argument("--port", type=int, default=DASHBOARD_PORT)
    parser.add_argument("--refresh", type=float, default=5.0, help="seconds between refreshes")
    parser.add_argument(
        "--replica",
        action="append",
        default=None,
        help=f"a rollout server to show (its open /health: version, lag, pause); repeat for "
        f"several (default: ${settings.REPLICAS.name}, comma-separated)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.bucket:
        print(f"error: pass --bucket or set {settings.BUCKET.name}", file=sys.stderr)
        return 2
    if not args.refresh > 0:
        print(f"error: --refresh must be > 0, got {args.refresh}", file=sys.stderr)
        return 2
    try:
        replicas = parse_replica_urls(" ".join(args.replica or [settings.REPLICAS.read()]))
        config = DashboardConfig(refresh_s=args.refresh, replicas=replicas)
        demo = build_dashboard(args.bucket, config)
    except (DeltaSyncError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    launch(demo, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
