"""The entry points (``main``, ``python -m``, the module-level ``app``): arguments, and the
settings read from the environment."""

from __future__ import annotations

import runpy
import sys
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from wordle_env.server import app as entry
from wordle_env.server.sessions import SessionLimits

DEADLINES = ("SESSION_FIRST_MESSAGE_TIMEOUT_S", "SESSION_IDLE_TIMEOUT_S", "SESSION_LIFETIME_S")
SETTINGS = (
    "MAX_CONCURRENT_ENVS",
    "ENABLE_WEB_INTERFACE",
    "SESSION_MAX_STEPS",
    "ENV_API_KEY",
    *DEADLINES,
)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Capture what main() hands to uvicorn instead of serving it."""
    captured: dict[str, Any] = {}

    def fake_run(app: FastAPI, **kwargs: Any) -> None:
        captured.update(kwargs, app=app)

    monkeypatch.setattr(entry.uvicorn, "run", fake_run)
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return captured


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> list[SessionLimits]:
    """The SessionLimits main() builds the app with."""
    seen: list[SessionLimits] = []
    build = entry.create_wordle_app

    def spy(capacity: int, limits: SessionLimits, **kwargs: Any) -> FastAPI:
        seen.append(limits)
        return build(capacity, limits, **kwargs)

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
    monkeypatch.setenv("SESSION_LIFETIME_S", "900")
    monkeypatch.setenv("SESSION_MAX_STEPS", "50")
    entry.main(["--log-level", "warning"])
    assert limits == [SessionLimits(first_message_s=2.5, idle_s=60.0, lifetime_s=900, max_steps=50)]
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


@pytest.mark.parametrize("value", ["short", "sixteen chars 16", "x" * 15])
def test_bad_api_key_is_a_one_line_error_that_does_not_echo_it(
    served: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    monkeypatch.setenv("ENV_API_KEY", value)
    with pytest.raises(SystemExit) as exit_info:
        entry.main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "ENV_API_KEY must be at least 16" in err
    assert value not in err and not served


@pytest.mark.parametrize(("first", "idle"), [(0, 1), (1, -1), (1, float("nan"))])
def test_session_limits_refuse_non_positive(first: float, idle: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        SessionLimits(first_message_s=first, idle_s=idle)


def _paths(app: FastAPI) -> set[str]:
    return {getattr(route, "path", "") for route in app.routes}


def test_web_page_only_when_enabled(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    entry.main([])
    assert "/web" not in _paths(served["app"])
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "True")
    entry.main([])
    assert {"/", "/web", "/web/step"} <= _paths(served["app"])


@pytest.mark.parametrize("value", ["on", "2", "enabled"])
def test_bad_web_switch_is_a_one_line_error(
    served: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", value)
    with pytest.raises(SystemExit) as exit_info:
        entry.main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"ENABLE_WEB_INTERFACE must be one of true, 1, yes, false, 0, no, got {value!r}" in err
    assert not served


def test_module_app_is_built_from_the_environment_on_first_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``uvicorn wordle_env.server.app:app``: importing builds nothing; the first use does."""
    monkeypatch.delitem(vars(entry), "app", raising=False)
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MAX_CONCURRENT_ENVS", "1")
    app = entry.app
    assert entry.app is app
    with TestClient(app) as client, client.websocket_connect("/ws") as first:
        first.send_json({"type": "reset", "data": {"word": "crane"}})
        assert first.receive_json()["type"] == "observation"
        with client.websocket_connect("/ws") as second:
            assert second.receive_json()["data"]["code"] == "CAPACITY_REACHED"
    with pytest.raises(AttributeError, match="has no attribute 'other'"):
        _ = entry.other


# runpy warns because this process imported the module already; a fresh ``python -m`` does not.
@pytest.mark.filterwarnings("ignore:'wordle_env.server.app' found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module", ["wordle_env.server", "wordle_env.server.app"])
def test_python_dash_m_runs_main(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert "usage: python -m wordle_env.server" in capsys.readouterr().out
