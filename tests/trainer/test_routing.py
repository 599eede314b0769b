"""Rollout routing: the trainer's proxy spreads TRL's generation requests over every replica that
is up and within TRL's staleness, skips a failing one for a cool-down and tries it again later,
and answers a quick one-line 503 when none can take a request.

The `Router` is tested alone with a fake clock; the proxy against real loopback servers that
record what reached each of them (`loopback_upstream`)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from loopback_upstream import Upstream, call, seen_by

from trainer.auth_proxy import AuthProxy
from trainer.routing import Liveness, NoReplica, Router, within_staleness

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


def test_a_busy_replica_gets_no_more_until_it_answers(fleet: list[Upstream]):
    slow = fleet[0]
    slow.hold.clear()
    with _proxy([u.url for u in fleet], TOKEN) as proxy:
        held = threading.Thread(target=_generate, args=(proxy,), daemon=True)
        held.start()  # the first request goes to fleet[0], which holds it
        assert slow.arrived.wait(10)
        _generate(proxy, 6)
        assert _counts(fleet) == [1, 3, 3]
        slow.hold.set()
        held.join(10)
        _generate(proxy, 3)
    assert _counts(fleet) == [2, 4, 4]


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
        synced.update({"vllm-0": 6, "vllm-2": 5})  # vllm-2 caught up: it generates again
        _generate(proxy, 3)
        assert _counts(fleet) == [6, 6, 1]
        synced.update({"vllm-0": 8, "vllm-1": 6})  # now vllm-1 and vllm-2 fall behind
        _generate(proxy, 4)
    assert _counts(fleet) == [10, 6, 1]


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
