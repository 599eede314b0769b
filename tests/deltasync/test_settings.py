"""The settings module reads each variable the one way: unset or blank gives the default, a
malformed value is one error that names the variable and changes nothing."""

from __future__ import annotations

import pytest

from deltasync import defaults, settings


@pytest.mark.parametrize(
    "setting, raw, value",
    [
        (settings.FOLLOW, "1", True),
        (settings.FOLLOW, "TRUE", True),
        (settings.FOLLOW, "0", False),
        (settings.GATE, " 1 ", True),
        (settings.FOLLOW_INTERVAL_S, "0.5", 0.5),
        (settings.PAUSE_DEADLINE_S, "120", 120.0),
        (settings.PORT, "8000", 8000),
        (settings.SOURCE_ROOTS, "/a:/b:", ("/a", "/b")),
        (settings.BLOCK_MODULES, "torchvision, torchaudio", ("torchvision", "torchaudio")),
        (settings.API_KEY, "secret", "secret"),
    ],
)
def test_a_set_variable_is_parsed(setting, raw, value):
    assert setting.read({setting.name: raw}) == value


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_unset_or_blank_gives_the_default(raw):
    environ = {} if raw is None else {settings.FOLLOW_INTERVAL_S.name: raw}
    assert settings.FOLLOW_INTERVAL_S.read(environ) == defaults.FOLLOW_INTERVAL_S
    assert settings.PAUSE_DEADLINE_S.read({}) == defaults.PAUSE_DEADLINE_S
    assert settings.PORT.read({}) == defaults.SPACE_PORT


@pytest.mark.parametrize(
    "setting, raw, message",
    [
        (settings.GATE, "yes", "DELTASYNC_GATE must be 1 or 0 (got 'yes')"),
        (settings.FOLLOW_INTERVAL_S, "soon", "must be a number of seconds"),
        (settings.PAUSE_DEADLINE_S, "-1", "must be a positive number of seconds"),
        (settings.PAUSE_DEADLINE_S, "nan", "must be a positive number of seconds"),
        (settings.PORT, "70000", "DELTASYNC_PORT must be a port number"),
    ],
)
def test_a_malformed_value_is_one_error_naming_the_variable(setting, raw, message):
    with pytest.raises(settings.SettingError, match="^" + setting.name) as info:
        setting.read({setting.name: raw})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_table_holds_each_variable_once_with_a_meaning():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) >= 10
    assert all(s.name.startswith("DELTASYNC_") and s.meaning for s in settings.SETTINGS)
    declared = {v for v in vars(settings).values() if isinstance(v, settings.Setting)}
    assert declared == set(settings.SETTINGS)


def test_reading_uses_this_process_environment_by_default(monkeypatch):
    monkeypatch.setenv(settings.GATE.name, "1")
    assert settings.GATE.read() is True
    monkeypatch.delenv(settings.GATE.name)
    assert settings.GATE.read() is False
