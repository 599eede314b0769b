"""``python -m wordle_env.server``: arguments, MAX_CONCURRENT_ENVS and the capacity it sets."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from wordle_env.server import __main__ as entry


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Capture what main() hands to uvicorn instead of serving it."""
    captured: dict[str, Any] = {}

    def fake_run(app: FastAPI, **kwargs: Any) -> None:
        captured.update(kwargs, app=app)

    monkeypatch.setattr(entry.uvicorn, "run", fake_run)
    monkeypatch.delenv("MAX_CONCURRENT_ENVS", raising=False)
    return captured


def test_defaults_bind_loopback_8002(served: dict[str, Any]) -> None:
    entry.main([])
    assert (served["host"], served["port"]) == ("127.0.0.1", 8002)


def test_capacity_from_environment(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_CONCURRENT_ENVS", "1")
    entry.main(["--host", "0.0.0.0", "--port", "8000"])
    assert (served["host"], served["port"]) == ("0.0.0.0", 8000)
    with TestClient(served["app"]) as client, client.websocket_connect("/ws") as first:
        first.send_json({"type": "reset", "data": {"word": "crane"}})
        assert first.receive_json()["type"] == "observation"
        with client.websocket_connect("/ws") as second:
            reply = second.receive_json()
        assert reply["data"]["code"] == "CAPACITY_REACHED"
        assert reply["data"]["max_sessions"] == 1


@pytest.mark.parametrize("value", ["abc", "0", "-3", ""])
def test_bad_capacity_is_a_one_line_error(
    served: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    monkeypatch.setenv("MAX_CONCURRENT_ENVS", value)
    with pytest.raises(SystemExit) as exit_info:
        entry.main([])
    assert exit_info.value.code == 2
    assert (
        f"MAX_CONCURRENT_ENVS must be a positive integer, got {value!r}" in capsys.readouterr().err
    )
    assert not served
