"""``python -m wordle_env.server``: arguments, and the settings read from the environment."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from wordle_env.server import __main__ as entry
from wordle_env.server.sessions import SessionLimits

DEADLINES = ("SESSION_FIRST_MESSAGE_TIMEOUT_S", "SESSION_IDLE_TIMEOUT_S")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Capture what main() hands to uvicorn instead of serving it."""
    captured: dict[str, Any] = {}

    def fake_run(app: FastAPI, **kwargs: Any) -> None:
        captured.update(kwargs, app=app)

    monkeypatch.setattr(entry.uvicorn, "run", fake_run)
    for name in ("MAX_CONCURRENT_ENVS", *DEADLINES):
        monkeypatch.delenv(name, raising=False)
    return captured


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> list[SessionLimits]:
    """The SessionLimits main() builds the app with."""
    seen: list[SessionLimits] = []
    build = entry.create_wordle_app

    def spy(capacity: int, limits: SessionLimits) -> FastAPI:
        seen.append(limits)
        return build(capacity, limits)

    monkeypatch.setattr(entry, "create_wordle_app", spy)
    return seen


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


def test_session_deadlines_default_to_10_and_300_seconds(
    served: dict[str, Any], limits: list[SessionLimits]
) -> None:
    entry.main([])
    assert limits == [SessionLimits(first_message_s=10.0, idle_s=300.0)]
    assert served["log_config"]["loggers"]["wordle_env"]["level"] == "INFO"


def test_session_deadlines_from_environment(
    served: dict[str, Any], limits: list[SessionLimits], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SESSION_FIRST_MESSAGE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("SESSION_IDLE_TIMEOUT_S", "60")
    entry.main(["--log-level", "warning"])
    assert limits == [SessionLimits(first_message_s=2.5, idle_s=60.0)]
    assert served["log_config"]["loggers"]["wordle_env"]["level"] == "WARNING"


@pytest.mark.parametrize("name", DEADLINES)
@pytest.mark.parametrize("value", ["abc", "0", "-3", "", "nan", "inf", "1e400"])
def test_bad_deadline_is_a_one_line_error(
    served: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        entry.main([])
    assert exit_info.value.code == 2
    assert f"{name} must be a positive number of seconds, got {value!r}" in capsys.readouterr().err
    assert not served


@pytest.mark.parametrize(("first", "idle"), [(0, 1), (1, -1), (1, float("nan"))])
def test_session_limits_refuse_non_positive(first: float, idle: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        SessionLimits(first_message_s=first, idle_s=idle)
