"""Rollout routing: the trainer's proxy spreads TRL's generation requests over every replica that
is up and within TRL's staleness, skips a failing one for a cool-down and tries it again later,
and answers a quick one-line 503 when none can take a request.

The `Router` is tested alone with a fake clock; the proxy against real loopback servers that
record what reached each of them (`loopback_upstream`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from loopback_upstream import Upstream, call, seen_by

from trainer.auth_proxy import AuthProxy
from trainer.routing import (
    COMPLETIONS_LINE,
    Liveness,
    NoReplica,
    Router,
    completions_line,
    read_completions,
    within_staleness,
)

TOKEN = "upstream-token"
# The stand-ins record every request: no /health probes here (they are tested on their own).
_proxy = functools.partial(AuthProxy, dead_after_s=None)
A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
COOLDOWN_S = 5.0  # longer than a dozen loopback requests take on a busy machine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _picks(router: Router, n: int, *, generation: bool = True) -> list[str | NoReplica]:
    """`n` requests one after another, each answered before the next."""
    out = []
    for _ in range(n):
        url = router.pick(generation=generation)
        out.append(url)
        if isinstance(url, str):
            router.started(url)
            router.finished(url, failure=None, generated=generation)
    return out


class Rollouts:
    """TRL's rollout worker in ticks of one second on `clock`: it keeps `inflight` generations
    in flight (`max_inflight_tasks`); each tick a replica answers all it holds, unless it is
    stuck until tick `stuck_until[url]` or answers only every `every[url]` ticks (a slower
    one). Requests at a replica that stalled on them are given up and sent again, as the proxy
    does."""

    def __init__(self, router: Router, clock: Clock, inflight: int = 8) -> None:
        self.router, self.clock, self.inflight, self.tick = router, clock, inflight, 0
        self.flying: list[tuple[str, float]] = []  # (replica, sent at)

    def held(self, url: str) -> int:
        return sum(u == url for u, _ in self.flying)

    def run(self, ticks: int, *, stuck_until: dict | None = None, every: dict | None = None):
        for _ in range(ticks):
            self.clock.now += 1.0
            while len(self.flying) < self.inflight:
                url = self.router.pick(generation=True)
                assert isinstance(url, str), url
                self.flying.append((url, self.router.started(url)))
            for url, since in list(self.flying):
                if why := self.router.stalled(url, since):
                    self.flying.remove((url, since))
                    self.router.finished(url, failure=why, since=since)
            for url, since in list(self.flying):
                answers = self.tick >= (stuck_until or {}).get(url, 0)
                if answers and self.tick % (every or {}).get(url, 1) == 0:
                    self.flying.remove((url, since))
                    self.router.finished(url, failure=None, generated=True, since=since)
            self.tick += 1
        return self.router.completions()


# --- the policy: which replicas are within staleness ---------------------------------------------


@pytest.mark.parametrize(
    ("synced", "max_staleness", "expected"),
    [
        ({}, 4, set()),  # nothing verified yet: nobody generates
        ({"r0": 7}, 0, {A}),  # one replica is always the newest
        ({"r0": 7, "r1": 7, "r2": 7}, 0, {A, B, C}),
        ({"r0": 7, "r1": 6, "r2": 5}, 1, {A, B}),
        ({"r0": 7, "r1": 6, "r2": 5}, 0, {A}),
        ({"r0": 3, "r1": 9}, 4, {B}),  # e.g. a restarted replica not yet verified again
        ({"r1": 9}, 4, {B}),  # r0 never verified (failed its first sync)
    ],
)
def test_within_staleness(synced: dict, max_staleness: int, expected: set):
    urls = {"r0": A, "r1": B, "r2": C}
    assert within_staleness(synced, urls, max_staleness) == expected


# --- the Router alone ---------------------------------------------------------------------------


def test_sequential_requests_take_turns():
    router = Router([A, B, C])
    assert _picks(router, 7) == [A, B, C, A, B, C, A]
    assert router.completions() == {A: 3, B: 2, C: 2}


def test_the_least_busy_replica_wins():
    router = Router([A, B, C])
    for url in (A, A, B):  # A has two requests in flight, B one, C none
        router.started(url)
    assert router.pick(generation=True) == C
    router.started(C)
    assert router.pick(generation=True) == B  # B and C hold one each; B's turn
    router.finished(A, failure=None)
    router.finished(A, failure=None)
    assert router.pick(generation=True) == A


def _rollouts(*upstreams: str, **router: float) -> Rollouts:
    clock = Clock()
    return Rollouts(Router(list(upstreams), clock=clock, **router), clock)


def test_a_stalled_replica_s_requests_go_to_the_other_and_it_starts_level_once_back():
    """B takes requests and answers none for 20 ticks (a hung engine, a partitioned Space):
    having answered fewest it draws them, until it has been quiet for `stall_s`; then they are
    sent to A and B sits out its cool-down, and once it answers again it starts level (it does
    not claim what A answered meanwhile) and the two share the rest."""
    rollouts = _rollouts(A, B, stall_s=3.0, cooldown_s=5.0)
    rollouts.run(3, stuck_until={B: 20})  # quiet for less than stall_s: B draws the requests
    assert rollouts.held(B) >= 7
    stuck = rollouts.run(17, stuck_until={B: 20})
    assert stuck[B] == 0 and stuck[A] >= 80, stuck  # of 136: rollouts went on at A
    settled = rollouts.run(10)  # its last cool-down, then it answers again
    assert settled[B] > 0
    done = rollouts.run(20)
    back = {url: done[url] - settled[url] for url in (A, B)}
    assert abs(back[A] - back[B]) <= 8, back


def test_a_replica_left_out_for_a_while_makes_up_its_share_at_once():
    """B generates nothing for 6 ticks (behind in versions, so not eligible): once it may
    again, it is sent every request until it has answered about as many as A, and is never
    taken for stalled while it answers (with a skew bound of 2 it stayed behind)."""
    eligible = {A, B}
    clock = Clock()
    rollouts = Rollouts(Router([A, B], lambda: eligible, clock=clock), clock)
    eligible.discard(B)
    left_out = rollouts.run(6)
    assert left_out[B] == 0 and left_out[A] >= 40
    eligible.add(B)
    done = rollouts.run(20)
    assert abs(done[A] - done[B]) <= 8, done


def test_a_replica_back_after_a_long_absence_makes_up_at_most_catch_up_answers():
    """B is left out for 100 ticks (800 answers behind): back, it is sent requests first only
    until it has made up `catch_up` of them, then the two share again, so A is never left idle
    for long."""
    eligible = {A}
    clock = Clock()
    rollouts = Rollouts(Router([A, B], lambda: eligible, clock=clock, catch_up=16), clock)
    rollouts.run(100)
    eligible.add(B)
    back = rollouts.run(4)
    after = rollouts.run(10)
    assert back[B] - 0 >= 16 and back[B] <= 16 + 8, back  # the 16 it may make up, then turns
    assert after[A] - back[A] >= 30 and after[B] - back[B] >= 30, after
    with pytest.raises(ValueError, match="catch_up"):
        Router([A], catch_up=0)


def test_long_generations_are_never_given_up():
    """Generations of 12 s, sent a second apart, with `stall_s` 10: before any answer no replica
    has shown it answers sooner, and once one has, the wait is 3x the longest generation."""
    clock = Clock()
    router = Router([A, B], clock=clock, stall_s=10.0)
    sent_a = router.started(A)
    clock.now += 1
    sent_b = router.started(B)
    clock.now += 10.5  # A's request is 11.5 s old, B has answered nothing yet
    assert router.stalled(A, sent_a) is None
    clock.now += 0.5
    router.finished(B, failure=None, generated=True, since=sent_b)  # took 11 s: wait 33 s
    assert router.stalled(A, sent_a) is None  # 12 s old, B idle: still within the wait
    clock.now += 22
    assert router.stalled(A, sent_a) is not None  # 34 s: longer than 3x any generation


def test_only_a_replica_that_answers_generations_takes_a_stalled_one_s_request():
    """A failed replica (refused, now out of its cool-down) takes nothing over; a read answered
    does not make a replica look alive."""
    clock = Clock()
    router = Router([A, B], clock=clock, stall_s=10.0, cooldown_s=5.0)
    sent_b = router.started(B)
    router.finished(B, failure=None, generated=True, since=sent_b)  # B has generated once
    router.started(B)
    router.finished(B, failure="refused the connection")
    sent_a = router.started(A)
    clock.now += 20  # B is out of its cool-down, still failing; A quiet for 20 s
    assert router.stalled(A, sent_a) is None
    router.finished(A, failure=None, since=router.started(A))  # a read at A answered
    assert router.stalled(A, sent_a) is None  # B still the only other: failing
    router.finished(B, failure=None, generated=True, since=router.started(B))
    assert router.stalled(A, sent_a) is not None  # B generates again: A's request moves


def test_a_slower_replica_still_gets_about_its_share():
    """C answers every other tick (e.g. two engines on one core): it holds more requests, so
    its batches are bigger and it answers about as many as the others (plain least-outstanding
    gave it 89 to their 150)."""
    done = _rollouts(A, B, C).run(60, every={C: 2})
    mean = sum(done.values()) / 3
    assert done[C] >= 0.9 * mean and max(done.values()) <= 1.5 * mean, done


def test_a_replica_back_from_failing_starts_level():
    """It does not claim the requests it missed while cooling down: a flapping replica would
    otherwise draw them all at once."""
    clock = Clock()
    router = Router([A, B], cooldown_s=5.0, clock=clock)
    router.started(A)
    router.finished(A, failure="answered 503")
    _picks(router, 10)
    clock.now += 5.1
    assert _picks(router, 4) == [A, B, A, B]


def test_a_failed_replica_holds_at_most_max_skew_more_until_it_answers():
    """Back from its cool-down, a replica that failed has answered fewest but is held to the
    skew bound (`max_skew=1`: no more than the least busy) until it answers once; then it is
    sent requests first again."""
    clock = Clock()
    router = Router([A, B], max_skew=1, clock=clock)
    router.started(B)
    router.finished(B, failure="answered 503")
    _picks(router, 4)  # A answers 4 while B cools down
    clock.now += 5.1
    held = []
    for _ in range(6):
        held.append(router.pick(generation=True))
        router.started(held[-1])
    assert held.count(B) == 3  # half of the 6 in flight
    router.finished(B, failure=None, generated=True)
    assert router.pick(generation=True) == B  # answering again: fewest answers first
    with pytest.raises(ValueError, match="max_skew"):
        Router([A], max_skew=0)
    with pytest.raises(ValueError, match="stall_s"):
        Router([A], stall_s=0)


def test_the_completions_line_reads_back():
    line = completions_line({A: 3, B: 0})
    assert line == f'rollout routing: completions per replica {{"{A}": 3, "{B}": 0}}'
    log = f"12:00:01 trainer.auth_proxy: {line}\nlater\n"
    assert read_completions(log) == {A: 3, B: 0}
    assert read_completions("nothing here") is None
    assert read_completions(f"{COMPLETIONS_LINE}{{'{A}': 3}}") is None  # not JSON: older line


def test_a_failing_replica_sits_out_its_cooldown_then_is_tried_again(
    caplog: pytest.LogCaptureFixture,
):
    clock = Clock()
    router = Router([A, B], cooldown_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="trainer.routing"):
        router.started(A)
        router.finished(A, failure="refused the connection")
        assert _picks(router, 4) == [B] * 4
        clock.now += 4.9
        assert _picks(router, 2) == [B] * 2
        clock.now += 0.2
        router.started(A)  # retried after the cool-down; it fails again: another cool-down
        router.finished(A, failure="answered 500")
        assert _picks(router, 2) == [B] * 2
        clock.now += 5.1
        assert set(_picks(router, 2)) == {A, B}  # back: both take turns again
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "no requests for 5 s" in m]) == 1  # one line per outage
    assert any(f"{A} answers again" in m for m in lines)


def test_a_request_the_caller_abandoned_does_not_cool_the_replica_down():
    router = Router([A, B])
    router.started(A)
    router.finished(A, failure=None, cancelled=True)
    assert _picks(router, 2) == [A, B]
    assert router.completions() == {A: 1, B: 1}  # the abandoned one is not counted


def test_generation_only_to_eligible_replicas_reads_to_any():
    eligible = {A, C}
    router = Router([A, B, C], lambda: eligible)
    assert set(_picks(router, 4)) == {A, C}
    assert set(_picks(router, 3, generation=False)) == {A, B, C}
    eligible = {B}  # the trainer's view changed: the next request follows it
    assert _picks(router, 2) == [B, B]


def test_nothing_eligible_is_a_one_line_reason():
    clock = Clock()
    router = Router([A, B, C], lambda: {A, B}, cooldown_s=5.0, clock=clock)
    router.started(A)
    router.finished(A, failure="refused the connection")
    assert _picks(router, 1) == [B]  # C is not eligible, A cooling: B
    router.started(B)
    router.finished(B, failure="answered 503")
    [refusal] = _picks(router, 1)
    assert isinstance(refusal, NoReplica)
    assert refusal.reason == (
        "no rollout replica can generate now (2 cooling down after errors, "
        "1 lagging beyond max_staleness or never synced; of 3); retry shortly"
    )
    assert isinstance(router.pick(generation=False), str)  # C still answers reads
    assert "\n" not in refusal.reason


@pytest.mark.parametrize("upstreams", [[], [A, A + "/"], A])
def test_upstreams_must_be_distinct_urls(upstreams):
    with pytest.raises((ValueError, TypeError)):
        Router(upstreams)


# --- liveness: which replicas are down, from /health probes -------------------------------------


def test_a_replica_is_down_once_its_probes_failed_for_dead_after_s(
    caplog: pytest.LogCaptureFixture,
):
    clock = Clock()
    liveness = Liveness([A, B], dead_after_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="trainer.routing"):
        for url in (A, B):
            liveness.probed(url, None)
        liveness.probed(A, "answered 503")
        clock.now += 9.9
        liveness.probed(A, "could not be reached")
        assert liveness.down() == {}
        clock.now += 0.1
        assert liveness.down() == {A: "/health could not be reached for 10 s"}
        clock.now += 5.0
        assert liveness.down() == {A: "/health could not be reached for 15 s"}
        liveness.probed(A, None)  # one answer ends the outage
        assert liveness.down() == {}
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if "is down" in m] == [
        f"rollout replica {A} is down: /health could not be reached for 10 s"
    ]  # one line per outage
    assert f"rollout replica {A} answers /health again" in lines


def test_a_failure_between_answers_starts_the_count_again():
    clock = Clock()
    liveness = Liveness([A], dead_after_s=10.0, clock=clock)
    liveness.probed(A, None)
    liveness.probed(A, "answered 503")
    clock.now += 8.0
    liveness.probed(A, None)
    liveness.probed(A, "answered 503")
    clock.now += 8.0
    assert liveness.down() == {}


def test_a_replica_that_never_answered_is_starting_not_down():
    clock = Clock()
    liveness = Liveness([A], dead_after_s=10.0, clock=clock)
    liveness.probed(A, "could not be reached")
    clock.now += 60.0
    liveness.probed(A, "could not be reached")
    assert liveness.down() == {}


@pytest.mark.parametrize("dead_after_s", [0.0, -1.0, float("nan")])
def test_dead_after_s_must_be_positive(dead_after_s: float):
    with pytest.raises(ValueError, match="dead_after_s"):
        Liveness([A], dead_after_s=dead_after_s)


# --- the proxy over real loopback servers -------------------------------------------------------


@pytest.fixture
def fleet() -> Iterator[list[Upstream]]:
    upstreams = [Upstream().start() for _ in range(3)]
    try:
        yield upstreams
    finally:
        for upstream in upstreams:
            upstream.stop()


def _generate(proxy: AuthProxy, n: int = 1) -> list[tuple[int, bytes]]:
    return [call(proxy.url, "POST", "/v1/completions", b'{"prompt": [1]}') for _ in range(n)]


def _counts(fleet: list[Upstream], method: str = "POST") -> list[int]:
    return [sum(s.method == method for s in u.seen) for u in fleet]


def test_completions_are_spread_over_every_replica(fleet: list[Upstream]):
    with _proxy([u.url for u in fleet], TOKEN) as proxy:
        replies = _generate(proxy, 30)
    assert [status for status, _ in replies] == [200] * 30
    assert _counts(fleet) == [10, 10, 10]
    assert proxy.router.completions() == {u.url: 10 for u in fleet}
    assert all(s.headers["Authorization"] == f"Bearer {TOKEN}" for s in seen_by(fleet))
    assert {s.path for s in seen_by(fleet)} == {"/v1/completions"}


def test_concurrent_completions_are_spread_evenly(fleet: list[Upstream]):
    """TRL keeps several requests in flight (`max_inflight_tasks`): equally fast replicas share
    them about equally."""
    for upstream in fleet:
        upstream.delay_s = 0.02
    with (
        _proxy([u.url for u in fleet], TOKEN) as proxy,
        ThreadPoolExecutor(8) as callers,
    ):
        replies = list(callers.map(lambda _: _generate(proxy)[0][0], range(48)))
    assert replies == [200] * 48
    counts = _counts(fleet)
    print(f"48 requests, 8 in flight: {counts}")
    assert sum(counts) == 48 and min(counts) >= 10, counts


@pytest.mark.whole_machine  # answers within a 0.5 s stall
def test_a_stalled_replica_s_request_is_answered_by_another(fleet: list[Upstream]):
    """fleet[0] takes a request and answers nothing (a hung engine, a partitioned Space): after
    `stall_s` the caller gets its answer from another replica, and fleet[0] sits out its
    cool-down."""
    slow = fleet[0]
    slow.hold.clear()
    with (
        _proxy([u.url for u in fleet], TOKEN, stall_s=0.5, cooldown_s=COOLDOWN_S) as proxy,
        ThreadPoolExecutor(1) as held,
    ):
        first = held.submit(_generate, proxy)  # fleet[0]'s turn: it holds it
        _wait_until(lambda: len(slow.seen) == 1, timeout_s=10)
        _generate(proxy, 2)  # the others answer at once
        assert _counts(fleet) == [1, 1, 1]
        assert first.result(10)[0][0] == 200  # given up at fleet[0], answered elsewhere
        assert sorted(_counts(fleet)) == [1, 1, 2]
        _generate(proxy, 4)  # fleet[0] is cooling down
        assert _counts(fleet)[0] == 1 and sum(_counts(fleet)) == 8
        slow.hold.set()


def test_no_request_is_given_up_while_every_replica_is_quiet(fleet: list[Upstream]):
    """Long generations: no replica answers for longer than `stall_s`, and none is given up
    (none has shown that it answers sooner)."""
    for upstream in fleet[:2]:
        upstream.hold.clear()
    with (
        _proxy([u.url for u in fleet[:2]], TOKEN, stall_s=0.3) as proxy,
        ThreadPoolExecutor(2) as callers,
    ):
        replies = [callers.submit(_generate, proxy) for _ in range(2)]
        _wait_until(lambda: sum(_counts(fleet)) == 2, timeout_s=10)
        time.sleep(1.0)
        for upstream in fleet[:2]:
            upstream.hold.set()
        assert [r.result(10)[0][0] for r in replies] == [200, 200]
    assert _counts(fleet) == [1, 1, 0]
    assert proxy.router.completions() == {fleet[0].url: 1, fleet[1].url: 1}


def test_a_replica_behind_in_answers_is_sent_the_most_until_it_catches_up(
    fleet: list[Upstream],
):
    """fleet[0] answers slower: it is sent requests first while it has answered fewest, so
    its batch grows and its answers keep up with the others'."""
    fleet[0].delay_s = 0.05
    with _proxy([u.url for u in fleet], TOKEN) as proxy, ThreadPoolExecutor(8) as callers:
        list(callers.map(lambda _: _generate(proxy), range(48)))
    counts = _counts(fleet)
    assert sum(counts) == 48 and max(counts) <= 1.5 * 16, counts


def test_a_lagging_replica_receives_no_completions(fleet: list[Upstream]):
    """The trainer's view (`within_staleness` over `transfer.state.synced`) decides per request."""
    synced = {"vllm-0": 5, "vllm-1": 5, "vllm-2": 3}
    named = {f"vllm-{i}": u.url for i, u in enumerate(fleet)}
    with _proxy(
        [u.url for u in fleet], TOKEN, eligible=lambda: within_staleness(synced, named, 1)
    ) as proxy:
        _generate(proxy, 10)
        assert _counts(fleet) == [5, 5, 0]
        for path in ("/health", "/v1/models", "/server_info"):  # reads go to any replica
            assert call(proxy.url, "GET", path)[0] == 200
        assert _counts(fleet, "GET") == [1, 1, 1]
        synced.update({"vllm-0": 6, "vllm-2": 5})  # vllm-2 caught up: it generates again,
        _generate(proxy, 3)  # first of all, making up for the requests it missed
        assert _counts(fleet) == [5, 5, 3]
        synced.update({"vllm-0": 8, "vllm-1": 6})  # now vllm-1 and vllm-2 fall behind
        _generate(proxy, 4)
    assert _counts(fleet) == [9, 5, 3]


def test_a_replica_that_refuses_is_skipped_then_retried(
    fleet: list[Upstream], caplog: pytest.LogCaptureFixture
):
    down = fleet[1]
    port = down.port
    down.stop()
    with (
        caplog.at_level(logging.INFO, logger="trainer.routing"),
        _proxy([u.url for u in fleet], TOKEN, cooldown_s=COOLDOWN_S) as proxy,
    ):
        started = time.monotonic()
        replies = _generate(proxy, 12)  # the one sent to the dead port goes on to the next
        assert [status for status, _ in replies] == [200] * 12
        assert _counts(fleet) == [6, 0, 6]
        down.start(port)  # back on its port, but still cooling down for a moment:
        if time.monotonic() - started < COOLDOWN_S / 2:  # (unless the machine was very slow)
            _generate(proxy, 3)
            assert _counts(fleet)[1] == 0  # skipped, though it would answer now
        _wait_until(lambda: bool(_generate(proxy, 3) and down.seen), timeout_s=4 * COOLDOWN_S)
        _generate(proxy, 6)
    assert _counts(fleet)[1] >= 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "refused the connection" in m]) == 1
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_replica_answering_5xx_is_skipped_then_retried(fleet: list[Upstream]):
    broken = fleet[0]
    broken.status = 500
    with _proxy([u.url for u in fleet], TOKEN, cooldown_s=COOLDOWN_S) as proxy:
        replies = _generate(proxy, 7)
        # the first went to fleet[0]: its 500 goes back to TRL (which retries); then it sits out
        assert [status for status, _ in replies] == [500] + [200] * 6
        assert _counts(fleet) == [1, 3, 3]
        broken.status = 200
        time.sleep(COOLDOWN_S + 0.1)
        _generate(proxy, 3)
    assert _counts(fleet) == [2, 4, 4]


def test_no_eligible_replica_is_a_quick_one_line_503(fleet: list[Upstream]):
    with _proxy([u.url for u in fleet], TOKEN, eligible=lambda: ()) as proxy:
        started = time.perf_counter()
        status, body = call(proxy.url, "POST", "/v1/completions", b"{}")
        took = time.perf_counter() - started
        assert call(proxy.url, "GET", "/health")[0] == 200  # reads still answered
    assert status == 503 and took < 5.0  # answered at once, not after a timeout
    assert body.decode().startswith("no rollout replica can generate now (3 lagging")
    assert "\n" not in body.decode() and TOKEN not in body.decode()
    assert _counts(fleet) == [0, 0, 0]


def test_every_replica_cooling_down_is_a_503(fleet: list[Upstream]):
    for upstream in fleet:
        upstream.status = 503  # e.g. replicas still bootstrapping
    with _proxy([u.url for u in fleet], TOKEN, cooldown_s=30) as proxy:
        first = [status for status, _ in _generate(proxy, 3)]
        status, body = _generate(proxy)[0]
    assert first == [503] * 3 and _counts(fleet) == [1, 1, 1]
    assert status == 503 and b"3 cooling down after errors" in body


def test_refusals_reach_no_replica_whichever_is_next(fleet: list[Upstream]):
    """The security checks run before a replica is chosen: interleaved with allowed requests
    (which take turns over the three), refused ones reach none of them."""
    refused = [
        ("POST", "/pause", {}, True),
        ("POST", "/v1/completions", {"Origin": "http://evil.example"}, True),
        ("POST", "/v1/completions", {"Host": "evil.example"}, True),
        ("POST", "/v1/completions", {}, False),  # no secret prefix
        ("GET", "/weight_info", {}, True),
    ]
    with _proxy([u.url for u in fleet], TOKEN) as proxy:
        for method, path, headers, prefix in refused * 3:
            body = b"{}" if method == "POST" else None
            status, _ = call(proxy.url, method, path, body, headers=headers, prefix=prefix)
            assert status in (403, 404)
            assert _generate(proxy)[0][0] == 200
    assert _counts(fleet) == [5, 5, 5]
    assert {(s.method, s.path) for s in seen_by(fleet)} == {("POST", "/v1/completions")}
    assert all(s.headers["Authorization"] == f"Bearer {TOKEN}" for s in seen_by(fleet))


def _wait_until(probe: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
