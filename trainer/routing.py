"""Which rollout replica serves each request that the trainer's proxy forwards.

TRL talks to one base URL. The trainer's proxy (`trainer.auth_proxy.AuthProxy`) holds a `Router`
over every replica: a generation request goes to one of those the trainer deems fresh enough
(`Eligible`, built in `trainer.train` from `within_staleness`) and that have not just failed,
by least requests in flight with a bounded skew (see `Router`), so that a replica whose requests
were stuck for a while (a sync's prefetch, a busy core) makes up its share once it answers; a
read (`/health`, `/v1/models`, `/server_info`) goes to any replica that has not just failed.
A replica that refuses a connection or answers 5xx sits out `cooldown_s`, then gets requests again;
the next failure starts another cool-down. Everything here runs on the proxy's event loop thread.

`Liveness` is the other half: from the proxy's periodic `/health` probes it tells which replicas
are down (they answered once, then nothing but failed probes for `dead_after_s`), so that a dead
engine behind a live API server (vLLM answers `/health` 503 within a second of its engine
process dying) or a server gone away ends the run with one line instead of TRL's minutes of
retries.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "COMPLETIONS_LINE",
    "Eligible",
    "Liveness",
    "NoReplica",
    "Router",
    "completions_line",
    "read_completions",
    "within_staleness",
]

log = logging.getLogger(__name__)

COMPLETIONS_LINE = "rollout routing: completions per replica "
"""The proxy's last log line starts with this, then a JSON object URL -> completions; the
launcher's summary and the benchmarks read it back from the trainer's log."""


def completions_line(completions: Mapping[str, int]) -> str:
    """The line the proxy logs on exit (`read_completions` parses it)."""
    return COMPLETIONS_LINE + json.dumps(dict(completions))


def read_completions(text: str) -> dict[str, int] | None:
    """Completions per replica URL from the last `completions_line` in a log; None if none."""
    for line in reversed(text.splitlines()):
        _, found, rest = line.partition(COMPLETIONS_LINE)
        if found:
            try:
                return {str(url): int(n) for url, n in json.loads(rest).items()}
            except (ValueError, AttributeError):  # a torn or older (repr) line
                return None
    return None


Eligible = Callable[[], Collection[str]]
"""The upstream URLs that may generate rollouts now (a subset of the router's upstreams).

Called once per generation request on the proxy's event loop: it must be cheap and must not
block (read in-memory state only). Reads do not consult it: TRL polls `/health` before any
version is synced.
"""


def within_staleness(
    synced: Mapping[str, int], urls: Mapping[str, str], max_staleness: int
) -> frozenset[str]:
    """The URLs of the replicas whose verified version is at most `max_staleness` behind the
    newest version verified on any replica.

    Args:
        synced: replica name -> last version the trainer verified it serves
            (`BucketWeightTransfer.state.synced`; copied here, the sync threads write it).
        urls: replica name -> URL, for every replica.
        max_staleness: TRL's `AsyncGRPOConfig.max_staleness`.

    Why this and no more: TRL stamps every sample with one shared `model_version` whichever
    replica produced it, and drops samples more than `max_staleness` versions older than its
    own; so replicas must be interchangeable, and one that is further behind the others than
    TRL would accept must not generate. A replica never verified (it failed its first sync, or
    none happened yet) is not eligible.

    Why "current" is the newest version verified on at least one replica, not the publisher's
    committed version: (1) it is a version some replica really serves, while right after every
    commit no replica serves the committed version until its stage and apply are done, so with
    `max_staleness=0` a committed-version rule would refuse all rollouts at every sync;
    (2) liveness: versions are only made after optimizer steps, which need rollouts, so a gate
    that can close on the whole fleet (all replicas behind the bucket after failed syncs) would
    never reopen and the run would stall; relative to the newest verified version the freshest
    replica always stays eligible. The lag of the whole fleet behind the trainer (upload and
    apply happen in the background) is the same with one replica; it is reported by the sync's
    `lagging` log line and the trainer's exit status, not by starving the rollouts. A replica
    marked lagging is judged by the version it last verified, which is what it serves (a failed
    sync changes nothing on a replica, or makes it re-bootstrap, which answers 503 and so sits
    out a cool-down).
    """
    versions = dict(synced)  # one atomic copy: the sync threads add to it meanwhile
    if not versions:
        return frozenset()
    newest = max(versions.values())
    return frozenset(
        urls[name]
        for name, version in versions.items()
        if name in urls and newest - version <= max_staleness
    )


@dataclass(frozen=True)
class NoReplica:
    """No replica can take the request; `reason` is one line for the caller and the log."""

    reason: str


@dataclass
class _Replica:
    url: str
    position: int
    outstanding: int = 0
    cool_until: float = 0.0
    failing: bool = False
    completions: int = 0
    forgiven: int = 0  # answers it missed while failing, not to be made up (`Router._even`)

    @property
    def share(self) -> int:
        """What routing balances: its answers plus those it does not claim."""
        return self.completions + self.forgiven


class Router:
    """Picks an upstream per request and keeps each one's requests in flight and cool-down.

    A read goes to the least busy replica (ties in turn). A generation goes to a replica holding
    fewer than `max_skew` requests more than the least busy one; among those, to the one that has
    answered the fewest so far, then the least busy, then in turn (a replica that failed starts
    level again once it answers). Why not plain least-outstanding: a replica whose requests are
    stuck (its first sync's prefetch, an engine sharing a core) gets nothing new while stuck,
    which is right, but once it answers it only gets an equal share of what comes next, so a
    stall early in a short run leaves it far behind for the whole run. Here it makes up its
    share, at most `max_skew` requests ahead of the least busy, so a replica that is really
    slower never holds more than that extra and the others are never starved either.
    `max_skew=1` is plain least-outstanding.

    Args:
        upstreams: the replicas' base URLs, at least one, no duplicates.
        eligible: which of them may generate now; None: all of them.
        cooldown_s: how long a replica that refused a connection or answered 5xx gets no
            request before it is tried again.
        max_skew: at least 1; how many more requests in flight a replica that is behind in
            answers may hold than the least busy one, after the new one.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        upstreams: Sequence[str],
        eligible: Eligible | None = None,
        *,
        cooldown_s: float = 5.0,
        max_skew: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_skew < 1:
            raise ValueError(f"max_skew must be at least 1, got {max_skew}")
        if isinstance(upstreams, str):
            raise TypeError("upstreams is a sequence of URLs, not one URL")
        urls = [u.rstrip("/") for u in upstreams]
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"expected one or more distinct upstream URLs, got {urls}")
        self._replicas = {u: _Replica(u, i) for i, u in enumerate(urls)}
        self._eligible = eligible
        self._cooldown_s = cooldown_s
        self._max_skew = max_skew
        self._clock = clock
        self._turn = 0  # the position that wins the next tie
        self._generating: frozenset[str] | None = None  # last eligible set, to log changes

    @property
    def upstreams(self) -> list[str]:
        return list(self._replicas)

    def completions(self) -> dict[str, int]:
        """Generation requests each upstream answered with 2xx so far."""
        return {u: r.completions for u, r in self._replicas.items()}

    def pick(self, *, generation: bool, tried: Collection[str] = ()) -> str | NoReplica:
        """The upstream for the next request, skipping those in `tried` (already failed it)."""
        now = self._clock()
        left = [r for r in self._replicas.values() if r.url not in tried]
        up = [r for r in left if r.cool_until <= now]
        ready = up
        if generation and self._eligible is not None:
            allowed = self._allowed()
            ready = [r for r in up if r.url in allowed]
        if not ready:
            return NoReplica(self._reason(generation, len(left) - len(up), len(up), len(tried)))
        best = self._best(ready) if generation else min(ready, key=self._busy)
        self._turn = (best.position + 1) % len(self._replicas)
        return best.url

    def _busy(self, replica: _Replica) -> tuple[int, int]:
        """Least busy first, ties in turn."""
        return replica.outstanding, (replica.position - self._turn) % len(self._replicas)

    def _best(self, ready: list[_Replica]) -> _Replica:
        """Fewest answers among those within `max_skew` of the least busy (see the class)."""
        floor = min(r.outstanding for r in ready)
        near = [r for r in ready if r.outstanding < floor + self._max_skew]
        return min(near, key=lambda r: (r.share, *self._busy(r)))

    def _even(self, back: _Replica) -> None:
        """A replica that answers again after failing starts level with the others: the requests
        it missed while out are not made up, which would pile them on a replica that may fail
        again (one stuck or left out for staleness does make up its share)."""
        ahead = max(r.share for r in self._replicas.values())
        back.forgiven += ahead - back.share

    def started(self, url: str) -> None:
        """A request was sent to `url` (call `finished` when it ends, whatever happened)."""
        self._replicas[url].outstanding += 1

    def finished(
        self, url: str, *, failure: str | None, generated: bool = False, cancelled: bool = False
    ) -> None:
        """The request to `url` ended: `failure` says how it failed (refused, 5xx, ...), None if
        the upstream answered; `generated`: it was a generation answered with 2xx; `cancelled`:
        the caller went away, which says nothing about the replica."""
        replica = self._replicas[url]
        replica.outstanding -= 1
        if cancelled:
            return
        if failure is None:
            replica.completions += generated
            if replica.failing:
                replica.failing = False
                self._even(replica)
                log.info("rollout replica %s answers again", url)
            return
        replica.cool_until = self._clock() + self._cooldown_s
        if not replica.failing:  # one line per outage, not per request
            replica.failing = True
            log.warning(
                "rollout replica %s %s: no requests for %.0f s, then retried",
                url,
                failure,
                self._cooldown_s,
            )

    def _allowed(self) -> frozenset[str]:
        allowed = frozenset(u.rstrip("/") for u in self._eligible())  # type: ignore[misc]
        if allowed != self._generating:
            self._generating = allowed
            left_out = sorted(set(self._replicas) - allowed)
            log.info(
                "rollouts go to %d of %d replicas%s",
                len(allowed & self._replicas.keys()),
                len(self._replicas),
                f"; not within staleness or not synced: {left_out}" if left_out else "",
            )
        return allowed

    def _reason(self, generation: bool, cooling: int, up: int, tried: int) -> str:
        parts = []
        if tried:
            parts.append(f"{tried} failed this request")
        if cooling:
            parts.append(f"{cooling} cooling down after errors")
        if up:
            parts.append(f"{up} lagging beyond max_staleness or never synced")
        what = "can generate" if generation else "is reachable"
        return (
            f"no rollout replica {what} now ({', '.join(parts)}; of {len(self._replicas)}); "
            "retry shortly"
        )


@dataclass
class _Health:
    answered: bool = False  # a probe succeeded once: a replica still starting is never down
    failing_since: float | None = None
    failure: str = ""
    down: bool = False  # declared down (logged once per outage)


class Liveness:
    """Which replicas are down, from `/health` probes; requests and routing do not feed it.

    A replica is down once it has answered a probe at least once and every probe since the
    first failure (refused, 5xx, no answer) has failed for `dead_after_s`; one answered probe
    makes it up again. A pause for a weight sync answers 200 (the deltasync middleware), so
    it never counts.

    Args:
        upstreams: the replicas' base URLs.
        dead_after_s: how long a replica's probes must fail before it is down.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        upstreams: Sequence[str],
        dead_after_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not dead_after_s > 0:
            raise ValueError(f"dead_after_s must be > 0, got {dead_after_s}")
        self._health = {u.rstrip("/"): _Health() for u in upstreams}
        self._dead_after_s = dead_after_s
        self._clock = clock

    def probed(self, url: str, failure: str | None) -> None:
        """One probe of `url` ended: `failure` is how it failed (one line), None if it answered."""
        health = self._health[url]
        if failure is None:
            if health.down:
                log.info("rollout replica %s answers /health again", url)
            health.answered, health.failing_since, health.down = True, None, False
            return
        if health.failing_since is None:
            health.failing_since = self._clock()
        health.failure = failure

    def down(self) -> dict[str, str]:
        """The replicas that are down, each with its one-line reason."""
        now = self._clock()
        out = {}
        for url, health in self._health.items():
            since = health.failing_since
            if not health.answered or since is None or now - since < self._dead_after_s:
                continue
            out[url] = f"/health {health.failure} for {now - since:.0f} s"
            if not health.down:
                health.down = True
                log.warning("rollout replica %s is down: %s", url, out[url])
        return out
