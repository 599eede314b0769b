"""Which rollout replica serves each request that the trainer's proxy forwards.

TRL talks to one base URL. The trainer's proxy (`trainer.auth_proxy.AuthProxy`) holds a `Router`
over every replica: a generation request goes to one of those the trainer deems fresh enough
(`Eligible`, built in `trainer.train` from `within_staleness`) and that have not just failed,
by fewest answers so far (see `Router`), so that a replica left out for a while (behind in
versions, a slower core) makes up its share once it can take requests again, while one that has
gone quiet holds at most a bounded few; a read (`/health`, `/v1/models`, `/server_info`) goes
to any replica that has not just failed. A replica that refuses a connection or answers 5xx sits
out `cooldown_s`, then gets requests again; the next failure starts another cool-down.
Everything here runs on the proxy's event loop thread.

`Liveness` is the other half: from the proxy's periodic `/health` probes it tells which replicas
are down (they answered once, then nothing but failed probes for `dead_after_s`), so that a dead
engine behind a live API server (vLLM answers `/health` 503 within a second of its engine
process dying) or a server gone away ends the run with one line instead of TRL's minutes of
retries.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
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
    quiet_since: float = 0.0  # its last generation answered, or its first request after none
    answered_at: float | None = None  # its last generation answered

    def stalled(self, now: float, wait_s: float) -> bool:
        """Requests in flight and no generation answered for `wait_s`: stuck, not busy."""
        return self.outstanding > 0 and now - self.quiet_since >= wait_s

    @property
    def share(self) -> int:
        """What routing balances: its answers plus those it does not claim."""
        return self.completions + self.forgiven


class Router:
    """Picks an upstream per request and keeps each one's requests in flight and cool-down.

    A read goes to the least busy replica (ties in turn). A generation goes to the replica that
    has answered the fewest so far (a deficit counts up to `catch_up` answers), then the least
    busy, then in turn. Two kinds are held to at most `max_skew` more requests in flight than
    the least busy: a *stalled* replica (requests in flight and no generation answered for the
    stall wait: a hung engine, a partitioned Space), and one that failed and has not answered
    since (it starts level once it does: `_even`). The proxy also gives up a request at a
    replica that stalled on it and sends it to one that answers (`stalled`). The stall wait is
    `stall_s` or 3x the longest of the last 64 generations, whichever is longer, so long
    generations never count as a stall.

    Why answers, not least-outstanding: a replica is left out now and then (more than
    `max_staleness` versions behind the freshest while its sync runs) or generates slower (a
    core it shares), and least-outstanding gives it only an equal part of what comes after, so
    it falls further behind each time: on 2 cores one of two local replicas answered 1.4 % of a
    run's rollouts, and with every replica's skew bounded by 2 the busiest still took up to
    1.8x the mean. Fewest answers first sends it what it missed as soon as it can take requests
    again (a bigger batch, which an engine runs at little extra cost per token) while the others
    keep the rest; in 9 local runs of 30-45 steps the busiest took 1.00-1.04x the mean. Why the
    bound for the stalled: a replica that takes requests and never answers has the fewest
    answers, so it would otherwise draw every request in flight. Why `catch_up`: a replica left
    out for minutes (a restart, a slow sync) would otherwise draw every request until it had
    answered as many as the others, leaving them idle.

    Args:
        upstreams: the replicas' base URLs, at least one, no duplicates.
        eligible: which of them may generate now; None: all of them.
        cooldown_s: how long a replica that refused a connection or answered 5xx gets no
            request before it is tried again.
        max_skew: at least 1; how many more requests in flight a stalled or failed replica may
            hold than the least busy one, after the new one.
        stall_s: the least time a replica with requests in flight may go without answering a
            generation before it counts as stalled (see the class for the wait it sets).
        catch_up: at least 1; the most answers a replica behind the others is sent first to
            make up.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        upstreams: Sequence[str],
        eligible: Eligible | None = None,
        *,
        cooldown_s: float = 5.0,
        max_skew: int = 2,
        stall_s: float = 10.0,
        catch_up: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_skew < 1:
            raise ValueError(f"max_skew must be at least 1, got {max_skew}")
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        if catch_up < 1:
            raise ValueError(f"catch_up must be at least 1, got {catch_up}")
        if isinstance(upstreams, str):
            raise TypeError("upstreams is a sequence of URLs, not one URL")
        urls = [u.rstrip("/") for u in upstreams]
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"expected one or more distinct upstream URLs, got {urls}")
        self._replicas = {u: _Replica(u, i) for i, u in enumerate(urls)}
        self._eligible = eligible
        self._cooldown_s = cooldown_s
        self._max_skew = max_skew
        self._stall_s = stall_s
        self._catch_up = catch_up
        self._took: deque[float] = deque(maxlen=64)  # the last generations' durations
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
        best = self._best(ready, now) if generation else min(ready, key=self._busy)
        self._turn = (best.position + 1) % len(self._replicas)
        return best.url

    def _busy(self, replica: _Replica) -> tuple[int, int]:
        """Least busy first, ties in turn."""
        return replica.outstanding, (replica.position - self._turn) % len(self._replicas)

    def _best(self, ready: list[_Replica], now: float) -> _Replica:
        """Fewest answers (a deficit counted up to `catch_up`); a stalled replica, or one not
        answering since it failed, only within `max_skew` of the least busy (see the class)."""
        floor = min(r.outstanding for r in ready)
        wait = self._stall_wait()
        near = [
            r
            for r in ready
            if r.outstanding < floor + self._max_skew or not (r.failing or r.stalled(now, wait))
        ]
        top = max(r.share for r in self._replicas.values())
        for r in near:  # a deficit beyond `catch_up` is not made up
            r.forgiven += max(0, top - self._catch_up - r.share)
        return min(near, key=lambda r: (r.share, *self._busy(r)))

    def _stall_wait(self) -> float:
        """How long a replica may hold requests without answering one: `stall_s`, or 3x the
        longest recent generation."""
        return max(self._stall_s, 3 * max(self._took, default=0.0))

    def stalled(self, url: str, since: float) -> str | None:
        """Why the generation request sent to `url` at `since` (`started`'s time) should go to
        another replica instead, or None. Given up when `url` has answered no generation since
        then, the request is older than the stall wait (see the class), and another replica
        that may take it (eligible, not cooling down or failing) is idle or answered a
        generation within that wait. This keeps a hung replica from holding every request in
        flight; while every replica is busy with generations longer than that, none is given
        up."""
        now = self._clock()
        replica = self._replicas[url]
        wait = self._stall_wait()
        if now - since < wait or (replica.answered_at or -math.inf) >= since:
            return None
        allowed = None if self._eligible is None else self._allowed()
        takers = [
            r
            for r in self._replicas.values()
            if r is not replica
            and not r.failing
            and r.cool_until <= now
            and (allowed is None or r.url in allowed)
            and r.answered_at is not None  # it has generated: not one that never came up
            and (r.outstanding == 0 or now - r.answered_at < wait)
        ]
        if not takers:
            return None
        return f"stalled (a generation unanswered for {now - since:.0f} s)"

    def _even(self, back: _Replica) -> None:
        """A replica that answers again after failing starts level with the others: the requests
        it missed while out are not made up, which would pile them on a replica that may fail
        again (one stuck or left out for staleness does make up its share)."""
        ahead = max(r.share for r in self._replicas.values())
        back.forgiven += ahead - back.share

    def started(self, url: str) -> float:
        """A request was sent to `url` (call `finished` when it ends, whatever happened); returns
        when, for `stalled` and `finished`."""
        now = self._clock()
        replica = self._replicas[url]
        if replica.outstanding == 0:
            replica.quiet_since = now
        replica.outstanding += 1
        return now

    def finished(
        self,
        url: str,
        *,
        failure: str | None,
        generated: bool = False,
        cancelled: bool = False,
        since: float | None = None,
    ) -> None:
        """The request to `url` ended: `failure` says how it failed (refused, 5xx, ...), None if
        the upstream answered; `generated`: it was a generation answered with 2xx; `cancelled`:
        the caller went away, which says nothing about the replica; `since`: when it was sent
        (`started`'s return), for the generations' durations."""
        replica = self._replicas[url]
        replica.outstanding -= 1
        if cancelled:
            return
        if failure is None:
            if generated:
                now = self._clock()
                replica.quiet_since = replica.answered_at = now
                replica.completions += 1
                if since is not None:
                    self._took.append(now - since)
            if replica.failing and generated:  # a read says nothing of its engine
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
