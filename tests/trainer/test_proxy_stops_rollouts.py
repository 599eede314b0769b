"""The trainer's proxy ends rollouts that cannot go on, at once and with one line, instead of
letting TRL retry for minutes: a generation request a replica refused for good (a final 4xx,
e.g. a prompt longer than the context), or every replica down (`/health` failing for
`dead_after_s`). One replica down of two changes nothing; a replica still starting is not down.

The proxy runs against real loopback servers standing in for vLLM (`loopback_upstream`); the
last test runs TRL's own rollout-worker code against it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
from loopback_upstream import REPLY, Upstream, call

from trainer.auth_proxy import AuthProxy

TOKEN = "upstream-token"
# vLLM 0.32's answer to a prompt longer than --max-model-len 512 (copied from a real server)
CONTEXT_OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 512 tokens. However, your prompt "
        "contains 599 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=599)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}


@pytest.fixture
def fleet() -> Iterator[list[Upstream]]:
    upstreams = [Upstream().start() for _ in range(2)]
    try:
        yield upstreams
    finally:
        for upstream in upstreams:
            upstream.stop()


def _generate(proxy: AuthProxy) -> tuple[int, dict]:
    status, body = call(proxy.url, "POST", "/v1/completions", b'{"prompt": [1]}')
    return status, json.loads(body)


def _posts(upstream: Upstream) -> int:
    return sum(s.method == "POST" for s in upstream.seen)


def _wait_for(what: str, probe: Callable[[], object], timeout_s: float) -> float:
    """Seconds until `probe()` is truthy (polled every 20 ms); fails after `timeout_s`."""
    started = time.monotonic()
    while not probe():
        assert time.monotonic() - started < timeout_s, f"no {what} after {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


# --- a generation request refused for good -------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_a_final_4xx_stops_rollouts_with_the_servers_answer(fleet: list[Upstream], status: int):
    refusing = fleet[0]
    refusing.status = status
    with AuthProxy([u.url for u in fleet], TOKEN, dead_after_s=None) as proxy:
        first = _generate(proxy)
        refusing.status = 200
        again = [_generate(proxy) for _ in range(3)]  # every later one too, reaching no replica
        read = call(proxy.url, "GET", "/health")  # reads are still forwarded unchanged
    reason = f"rollout server {refusing.url} refused a generation request (HTTP {status}): "
    assert proxy.stop_reason == reason + json.dumps({"error": status})
    stopped = (200, {"error": {"message": proxy.stop_reason, "type": "RolloutsStopped"}})
    assert first == stopped and again == [stopped] * 3
    assert [_posts(u) for u in fleet] == [1, 0]
    assert read[0] == 200 and json.loads(read[1]) == REPLY


@pytest.mark.parametrize("status", [408, 429])
def test_a_timeout_or_rate_limit_is_passed_on_for_trl_to_retry(fleet: list[Upstream], status: int):
    fleet[0].status = status
    with AuthProxy([fleet[0].url], TOKEN, dead_after_s=None) as proxy:
        assert _generate(proxy) == (status, {"error": status})
        fleet[0].status = 200
        assert _generate(proxy) == (200, REPLY)
    assert proxy.stop_reason is None


class _ContextOverflow(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps(CONTEXT_OVERFLOW).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_prompt_longer_than_the_context_says_which_flags_fix_it():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ContextOverflow)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with AuthProxy([url], TOKEN, dead_after_s=None) as proxy:
            status, body = _generate(proxy)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200 and body["error"]["message"] == proxy.stop_reason
    assert proxy.stop_reason == (
        f"a rollout's prompt does not fit the context of rollout server {url}: "
        f"{CONTEXT_OVERFLOW['error']['message']} Raise the replicas' --max-model-len "
        "(launch.py --vllm-args) or shorten rollouts (trainer --max-tool-calls, "
        "--max-completion-length)"
    )


# --- replicas down -------------------------------------------------------------------------------


def _probed(upstream: Upstream) -> bool:
    """A probe of `upstream` was answered and counted: the proxy probes in rounds, so a second
    probe seen means the first one's answer reached `Liveness` (a replica that never answered
    is never down; the first probe alone is seen before its answer is written)."""
    return sum(s.path == "/health" for s in upstream.seen) >= 2


@pytest.mark.whole_machine  # a stop within 3 s
def test_every_replica_down_stops_rollouts_within_dead_after_s(fleet: list[Upstream]):
    with AuthProxy([u.url for u in fleet], TOKEN, dead_after_s=0.6, probe_s=0.05) as proxy:
        _wait_for("probes", lambda: all(_probed(u) for u in fleet), timeout_s=10)
        assert proxy.stop_reason is None and _generate(proxy) == (200, REPLY)
        for upstream in fleet:
            upstream.stop()  # connections refused from now on
        took = _wait_for("stop", lambda: proxy.stop_reason, timeout_s=10)
        status, body = _generate(proxy)
    print(f"every replica down: rollouts stopped after {took:.2f} s (dead_after_s 0.6)")
    assert 0.6 <= took < 3.0
    assert proxy.stop_reason == "every rollout replica is down: " + "; ".join(
        f"{u.url} /health could not be reached for 1 s" for u in fleet
    )
    assert (status, body["error"]["message"]) == (200, proxy.stop_reason)


def test_a_live_server_whose_health_fails_is_down(fleet: list[Upstream]):
    """vLLM's API server outlives its dead engine with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 (or
    while it shuts down) and answers `/health` 503."""
    replica = fleet[0]
    with AuthProxy([replica.url], TOKEN, dead_after_s=0.6, probe_s=0.05) as proxy:
        _wait_for("an answered probe", lambda: _probed(replica), timeout_s=10)
        replica.status = 503
        _wait_for("stop", lambda: proxy.stop_reason, timeout_s=10)
    assert (
        proxy.stop_reason == f"rollout replica {replica.url} is down: /health answered 503 for 1 s"
    )


def test_one_replica_down_of_two_keeps_rollouts_going(fleet: list[Upstream]):
    down, up = fleet
    with AuthProxy([u.url for u in fleet], TOKEN, dead_after_s=0.3, probe_s=0.05) as proxy:
        _wait_for("probes", lambda: all(_probed(u) for u in fleet), timeout_s=10)
        down.stop()
        liveness = proxy.liveness
        assert liveness is not None
        _wait_for("the outage", liveness.down, timeout_s=10)
        replies = [_generate(proxy) for _ in range(4)]
    assert proxy.stop_reason is None
    assert replies == [(200, REPLY)] * 4 and _posts(up) == 4


def test_a_replica_that_never_answered_is_still_starting(fleet: list[Upstream]):
    starting = fleet[0]
    starting.stop()  # nothing listens yet: the trainer waits for it before training
    with AuthProxy([starting.url], TOKEN, dead_after_s=0.2, probe_s=0.05) as proxy:
        time.sleep(1.0)
    assert proxy.stop_reason is None


# --- TRL's rollout worker and the stop answer ---------------------------------------------------


def test_trls_rollout_worker_retries_http_errors_but_not_the_stop_answer(fleet: list[Upstream]):
    """TRL 1.16 retries every aiohttp error, a 4xx's `ClientResponseError` included, 30x3 times
    with backoff; the stop answer (a 200 without `choices`) fails its rollout on the first try,
    which ends TRL's rollout child and so the run."""
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    assert issubclass(aiohttp.ClientResponseError, trl_worker._RETRYABLE_HTTP_ERRORS)
    fleet[0].status = 404
    with AuthProxy([fleet[0].url], TOKEN, dead_after_s=None) as proxy:

        async def one_turn() -> None:
            loop = object.__new__(trl_worker._AsyncRolloutLoop)  # only what one turn reads
            loop.__dict__.update(
                vllm_server_url=proxy.url,
                model_name="m",
                lora_name=None,
                max_tokens=4,
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                min_p=None,
                repetition_penalty=1.0,
                request_timeout=10,
                _counters=defaultdict(float),
            )
            async with aiohttp.ClientSession() as loop.session:
                await loop._generate_one_turn([1, 2, 3])

        started = time.monotonic()
        with pytest.raises(KeyError, match="choices"):
            asyncio.run(one_turn())
        took = time.monotonic() - started
    assert took < 5.0 and _posts(fleet[0]) == 1  # no retry (TRL's would back off for seconds)
    assert proxy.stop_reason is not None and "HTTP 404" in proxy.stop_reason
