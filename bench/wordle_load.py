"""Wordle server under load: games per second, step latency and server memory on loopback.

    python -m bench.wordle_load --runs 3 --json bench/results/wordle-load.json  # 256 x 4 games
    python -m bench.wordle_load --sessions 256 --games 8
    python -m bench.wordle_load --url http://127.0.0.1:8002   # a running server (no RSS)

Starts ``python -m wordle_env.server`` on a free 127.0.0.1 port (capacity = --sessions), opens
--sessions WebSocket sessions at once and has each play --games full games (reset, then six
guesses: a win on the sixth for even games, a loss for odd ones), --runs times, each against a
fresh server. Latency is measured per step frame, send to reply, on the client. The client
shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

from deltasync.arguments import count, http_url, json_path

from .output import report

REPO_ROOT = Path(__file__).resolve().parents[1]
FILLERS = ("slate", "pious", "dwelt", "handy", "eerie", "robot")
STARTUP_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Result:
    sessions: int
    games: int
    seconds: float
    games_per_s: float
    steps_per_s: float
    step_p50_ms: float
    step_p99_ms: float
    server_rss_mib: float | None
    server_peak_rss_mib: float | None


async def _ask(ws: ClientConnection, frame: dict[str, object]) -> dict[str, object]:
    await ws.send(json.dumps(frame))
    reply = json.loads(await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT_S))
    if reply["type"] != "observation":
        raise RuntimeError(f"server answered {reply}")
    return reply["data"]


async def _session(url: str, index: int, games: int, latencies: list[float]) -> None:
    async with connect(url, open_timeout=REPLY_TIMEOUT_S) as ws:
        for game in range(games):
            secret = "crane"
            guesses = [*FILLERS[:5], secret] if game % 2 == 0 else list(FILLERS)
            await _ask(
                ws, {"type": "reset", "data": {"word": secret, "episode_id": f"{index}-{game}"}}
            )
            for guess in guesses:
                start = time.perf_counter()
                data = await _ask(ws, {"type": "step", "data": {"message": f"[{guess}]"}})
                latencies.append(time.perf_counter() - start)
            if not data["done"]:
                raise RuntimeError(f"session {index} game {game} did not end after six guesses")
        await ws.send(json.dumps({"type": "close"}))


async def _drive(ws_url: str, sessions: int, games: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(_session(ws_url, i, games, latencies) for i in range(sessions)))
    return time.perf_counter() - start, latencies


def _rss_mib(pid: int) -> tuple[float | None, float | None]:
    """Current and peak resident memory of a process, from /proc (Linux only)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None, None
    fields = {k: v for k, _, v in (line.partition(":") for line in lines)}
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _start_server(sessions: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MAX_CONCURRENT_ENVS": str(sessions)}
    env.pop("ENABLE_WEB_INTERFACE", None)
    command = [sys.executable, "-m", "wordle_env.server", "--port", str(port)]
    proc = subprocess.Popen([*command, "--log-level", "warning"], cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not come up within {STARTUP_TIMEOUT_S} s")


def run(sessions: int, games: int, url: str | None) -> Result:
    """Play sessions x games games against ``url``, or against a server started here."""
    proc = None
    if url is None:
        proc, url = _start_server(sessions)
    try:
        ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + "/ws"
        seconds, latencies = asyncio.run(_drive(ws_url, sessions, games))
        rss, peak = _rss_mib(proc.pid) if proc else (None, None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    cuts = statistics.quantiles(latencies, n=100)
    return Result(
        sessions=sessions,
        games=sessions * games,
        seconds=round(seconds, 3),
        games_per_s=round(sessions * games / seconds, 1),
        steps_per_s=round(len(latencies) / seconds, 1),
        step_p50_ms=round(cuts[49] * 1000, 2),
        step_p99_ms=round(cuts[98] * 1000, 2),
        server_rss_mib=None if rss is None else round(rss, 1),
        server_peak_rss_mib=None if peak is None else round(peak, 1),
    )


def table(results: list[Result]) -> str:
    """One row per run."""
    lines = [
        "| run | games/s | p50 step latency | p99 step latency | server RSS (peak) |",
        "|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        rss = "-" if r.server_rss_mib is None else f"{r.server_rss_mib:.0f} MiB"
        peak = "" if r.server_peak_rss_mib is None else f" ({r.server_peak_rss_mib:.0f})"
        lines.append(
            f"| {i} | {r.games_per_s} | {r.step_p50_ms:.0f} ms | {r.step_p99_ms:.0f} ms | "
            f"{rss}{peak} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.wordle_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=count, default=256, help="concurrent sessions")
    parser.add_argument("--games", type=count, default=4, help="games per session")
    parser.add_argument("--runs", type=count, default=1, help="runs, each on a fresh server")
    parser.add_argument("--url", type=http_url, help="use this server instead of starting one")
    parser.add_argument("--json", type=json_path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.url is not None:
        try:
            with urllib.request.urlopen(f"{args.url}/health", timeout=5):
                pass
        except OSError as exc:  # refused, unknown host, timeout, HTTP error
            parser.error(f"--url {args.url}: no Wordle server answers /health ({exc})")
    results = [run(args.sessions, args.games, args.url) for _ in range(args.runs)]
    command = "python -m bench.wordle_load " + " ".join(argv if argv is not None else sys.argv[1:])
    report(table(results), {"command": command, "runs": [asdict(r) for r in results]}, args.json)


if __name__ == "__main__":
    main()
