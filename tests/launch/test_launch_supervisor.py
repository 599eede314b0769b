"""The local supervisor with small Python children: one prefixed stream, readiness, failures with
the last lines (also of a process that runs on while its health check fails), and no process left
behind, also one that left our process group."""

from __future__ import annotations

import io
import re
import socket
import sys
import time

import psutil
import pytest

from launcher import supervisor
from launcher.errors import ProcessFailed
from launcher.supervisor import ProcessSpec, Supervisor

PY = sys.executable


def _spec(name: str, code: str, **kw) -> ProcessSpec:
    return ProcessSpec(name, (PY, "-c", code), **kw)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_prefixed_stream_ready_line_and_exit_status(tmp_path):
    out = io.StringIO()
    with Supervisor(out=out, log_dir=tmp_path) as sup:
        server = sup.start(
            _spec(
                "svc",
                "import time; print('booting'); print('ready on x'); time.sleep(60)",
                ready_line="ready on",
                stop_grace_s=5,
            )
        )
        sup.wait_ready([server], timeout_s=30)
        main = sup.start(_spec("main", "print('hello'); raise SystemExit(3)"))
        assert sup.wait_exit(main, timeout_s=30) == 3
    text = out.getvalue()
    assert "      svc | booting\n" in text and "     main | hello\n" in text
    assert "stopping svc" in text
    assert server.proc.poll() is not None
    assert (tmp_path / "svc.log").read_text() == "booting\nready on x\n"


def test_ready_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    with Supervisor(out=io.StringIO()) as sup:
        web = sup.start(_spec("web", code, ready_url=f"http://127.0.0.1:{port}/", stop_grace_s=5))
        sup.wait_ready([web], timeout_s=30)
        assert web.ready.is_set()


def test_a_child_dying_during_start_up_fails_with_its_last_lines():
    with Supervisor(out=io.StringIO()) as sup:
        bad = sup.start(
            _spec(
                "bad",
                "print('loading'); print('OSError: boom'); raise SystemExit(1)",
                ready_line="ready on",
            )
        )
        with pytest.raises(ProcessFailed, match=r"bad exited with status 1 during start-up") as e:
            sup.wait_ready([bad], timeout_s=30)
    assert "OSError: boom" in str(e.value) and e.value.returncode == 1


def test_a_service_dying_while_the_main_process_runs_fails():
    with Supervisor(out=io.StringIO()) as sup:
        sup.start(_spec("svc", "import time; time.sleep(0.5); raise SystemExit(7)"))
        main = sup.start(_spec("main", "import time; time.sleep(60)", stop_grace_s=5))
        with pytest.raises(ProcessFailed, match="svc exited with status 7 while main was running"):
            sup.wait_exit(main, timeout_s=30)
    assert main.proc.poll() is not None


def test_startup_timeout():
    with Supervisor(out=io.StringIO()) as sup:
        slow = sup.start(
            _spec(
                "slow",
                "import time; print('x'); time.sleep(60)",
                ready_line="ready on",
                stop_grace_s=5,
            )
        )
        with pytest.raises(ProcessFailed, match="slow not ready after 1s"):
            sup.wait_ready([slow], timeout_s=1)


def test_stop_kills_a_stubborn_group_and_a_descendant_in_its_own_session(tmp_path):
    """Like vLLM's server: the child starts a grandchild with a session of its own, and both
    ignore SIGTERM; after the supervisor exits neither is left."""
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'], "
        "start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "print('ready on 1', flush=True)\n"
        "time.sleep(300)\n"
    )
    out = io.StringIO()
    started = time.monotonic()
    with Supervisor(out=out) as sup:
        child = sup.start(_spec("stubborn", code, ready_line="ready on", stop_grace_s=1))
        sup.wait_ready([child], timeout_s=30)
        sup.wait_exit(sup.start(_spec("main", "pass")), timeout_s=30)
    grandchild = int(pid_file.read_text())
    assert _gone(child.proc.pid) and _gone(grandchild)
    assert "stopped 1 leftover process(es)" in out.getvalue()
    assert time.monotonic() - started < 30


def test_keyboard_interrupt_stops_everything():
    with pytest.raises(KeyboardInterrupt), Supervisor(out=io.StringIO()) as sup:
        child = sup.start(_spec("svc", "import time; time.sleep(60)", stop_grace_s=5))
        raise KeyboardInterrupt
    assert child.proc.poll() is not None


def test_a_finished_step_is_not_a_failure():
    with Supervisor(out=io.StringIO()) as sup:
        assert sup.wait_exit(sup.start(_spec("prepare", "print('built')")), timeout_s=30) == 0
        main = sup.start(_spec("main", "import time; time.sleep(1)"))
        assert sup.wait_exit(main, timeout_s=30) == 0


# A service that stays alive while its health fails, as a vLLM API server whose engine died:
# `/health` answers 200 until the file `mode` says "503" (answer that) or "close" (stop
# listening but keep running, e.g. a server stuck in its shutdown); "ok" again heals it.
_FLAKY = """
import http.server as h, pathlib, sys, threading, time
mode = pathlib.Path(sys.argv[1])
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode.read_text() == "503" else 200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = h.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H)
threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
print("serving", flush=True)
while mode.read_text() != "close":
    time.sleep(0.05)
server.shutdown()
server.server_close()
print("stopped listening", flush=True)
time.sleep(300)
"""


def _flaky(tmp_path, unhealthy_after_s: float) -> tuple[ProcessSpec, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mode = tmp_path / "mode"
    mode.write_text("ok")
    spec = ProcessSpec(
        "svc",
        (PY, "-c", _FLAKY, str(mode), str(port)),
        ready_url=f"http://127.0.0.1:{port}/health",
        health_url=f"http://127.0.0.1:{port}/health",
        unhealthy_after_s=unhealthy_after_s,
        stop_grace_s=5,
    )
    return spec, mode


@pytest.mark.parametrize(
    ("mode", "failure"),
    [("503", "answered 503"), ("close", "could not be reached ([Errno 111] Connection refused)")],
)
def test_a_live_service_whose_health_fails_fails_with_its_last_lines(
    tmp_path, monkeypatch: pytest.MonkeyPatch, mode: str, failure: str
):
    monkeypatch.setattr(supervisor, "_PROBE_S", 0.1)
    spec, mode_file = _flaky(tmp_path, unhealthy_after_s=1.0)
    with Supervisor(out=io.StringIO()) as sup:
        svc = sup.start(spec)
        sup.wait_ready([svc], timeout_s=30)
        main = sup.start(_spec("main", "import time; time.sleep(60)", stop_grace_s=5))
        mode_file.write_text(mode)
        started = time.monotonic()
        with pytest.raises(ProcessFailed) as e:
            sup.wait_exit(main, timeout_s=30)
        took = time.monotonic() - started
        assert svc.proc.poll() is None  # it still runs: the failure is its health
    first, *rest = str(e.value).splitlines()
    assert re.fullmatch(  # "for 1 s" unless the machine is slow to poll
        rf"svc is unhealthy: {re.escape(f'{spec.health_url} {failure}')} for \d+ s while "
        "main was running; its last lines:",
        first,
    ), first
    assert "    serving" in rest and e.value.name == "svc"
    assert 1.0 <= took < 10.0
    assert svc.proc.poll() is not None and main.proc.poll() is not None


def test_health_that_comes_back_in_time_is_no_failure(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(supervisor, "_PROBE_S", 0.1)
    spec, mode_file = _flaky(tmp_path, unhealthy_after_s=2.0)
    code = f"import pathlib, time; m = pathlib.Path({str(mode_file)!r}); " + (
        "m.write_text('503'); time.sleep(1.0); m.write_text('ok'); time.sleep(2.0)"
    )
    with Supervisor(out=io.StringIO()) as sup:
        svc = sup.start(spec)
        sup.wait_ready([svc], timeout_s=30)
        assert sup.wait_exit(sup.start(_spec("main", code)), timeout_s=30) == 0
