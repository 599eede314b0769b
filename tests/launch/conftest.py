"""A fake `hf` on PATH with a tiny Hub in a JSON file; every recorded call must parse with the
real CLI's argument parser (checked when each test ends)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
HF_FAKE = Path(__file__).with_name("hf_fake.py")


@dataclass
class Result:
    code: int
    out: str
    err: str

    def commands(self) -> list[list[str]]:
        """The `$ hf ...` lines launch.py printed, as argv lists (without `hf`)."""
        lines = [x.strip()[2:] for x in self.out.splitlines() if x.strip().startswith("$ hf ")]
        return [shlex.split(x)[1:] for x in lines]


class FakeHub:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        hf = self.bin / "hf"
        hf.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HF_FAKE}" "$@"\n')
        hf.chmod(0o755)
        self.state_path = tmp / "hub.json"
        self.log_path = tmp / "calls.jsonl"
        self.log_path.touch()
        self.workdir = tmp / "work"
        self.state = {"user": "alice", "orgs": ["team"], "spaces": {}, "buckets": {}}
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}/usr/bin{os.pathsep}/bin")
        monkeypatch.setenv("FAKE_HF_STATE", str(self.state_path))
        monkeypatch.setenv("FAKE_HF_LOG", str(self.log_path))
        monkeypatch.delenv("DELTASYNC_API_KEY", raising=False)
        monkeypatch.delenv("DELTASYNC_READ_TOKEN", raising=False)

    @property
    def state(self) -> dict:
        return json.loads(self.state_path.read_text())

    @state.setter
    def state(self, value: dict) -> None:
        self.state_path.write_text(json.dumps(value, indent=1))

    def update(self, **changes) -> None:
        self.state = {**self.state, **changes}

    def calls(self) -> list[list[str]]:
        return [json.loads(x)["argv"] for x in self.log_path.read_text().splitlines()]

    def clear_calls(self) -> None:
        self.all_calls = [*getattr(self, "all_calls", []), *self.calls()]
        self.log_path.write_text("")

    def launch(self, *args: str, stdin: str = "") -> Result:
        """`python launch.py ARGS --workdir WORK --poll-interval 0`, in this process."""
        import launch

        out, err = io.StringIO(), io.StringIO()
        argv = [*args]
        extra = []
        if "--" in argv:
            extra = argv[argv.index("--") :]
            argv = argv[: argv.index("--")]
        argv += ["--workdir", str(self.workdir), "--poll-interval", "0", *extra]
        old_stdin = sys.stdin
        sys.stdin = io.StringIO(stdin)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = launch.main(argv)
                except SystemExit as exc:  # argparse errors
                    code = exc.code
        finally:
            sys.stdin = old_stdin
        return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path, monkeypatch)
    yield fake
    from hf_grammar import parse_hf

    for argv in [*getattr(fake, "all_calls", []), *fake.calls()]:
        parse_hf(argv)  # raises click.ClickException if the real CLI would refuse it
