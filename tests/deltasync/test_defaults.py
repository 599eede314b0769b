"""One block of defaults: README's table names exactly the `DELTASYNC_*` variables the parts read,
and the literals the Space images keep (a Dockerfile and a shell entrypoint cannot import Python)
agree with `deltasync.defaults`."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import metadata_load

from deltasync import defaults, settings
from wordle_env.server.settings import ServerSettings

REPO = Path(__file__).resolve().parents[2]
_VARIABLE = re.compile(r"\bDELTASYNC_[A-Z][A-Z_]*[A-Z]\b")


def _tracked(*patterns: str) -> list[Path]:
    found = subprocess.run(
        ["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / f for f in found if not f.startswith("tests/")]


def test_readme_table_is_the_settings_table():
    """README's rows are `settings.SETTINGS`, name and meaning, and every variable any file
    names (code, images, Space cards) is one of them."""
    readme = (REPO / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(DELTASYNC_\w+)` \| (.*) \|$", readme, flags=re.M))
    assert rows == {s.name: s.meaning for s in settings.SETTINGS}
    sources = _tracked("*.py", "*.sh", "*Dockerfile", "spaces/*/README.md")
    named = {v for path in sources for v in _VARIABLE.findall(path.read_text())}
    assert len(named) >= 10 and named == set(rows)


def test_every_setting_has_a_reader():
    """A setting is read through the module (`settings.NAME`) or by a file that cannot import
    it (the image's shell entrypoint, sitecustomize)."""
    texts = [p.read_text() for p in _tracked("*.py", "*.sh") if p.name != "settings.py"]
    attributes = {v: k for k, v in vars(settings).items() if isinstance(v, settings.Setting)}
    unread = [
        s.name
        for s in settings.SETTINGS
        if not any(f"settings.{attributes[s]}" in t or f"${{{s.name}" in t for t in texts)
        and not any(s.name in t for t in texts if "sys.modules" in t)
    ]
    assert unread == []


# the one reader besides the settings module: it runs at interpreter start, before any import
_READERS = {"deltasync/settings.py", "deltasync/vllm_ext/server/_site/sitecustomize.py"}


def variable_names_defined(text: str) -> list[str]:
    """Where Python source spells a variable's name as a value of its own: a string that is
    exactly a `DELTASYNC_*` name (an `environ.get(...)` key, a dict key, a constant) or a
    keyword argument so named (`dict(os.environ, DELTASYNC_X=...)`). Prose that names one is
    fine."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        elif isinstance(node, ast.keyword) and node.arg:
            name = node.arg
        else:
            continue
        if _VARIABLE.fullmatch(name):
            found.append(f"{getattr(node, 'lineno', getattr(node.value, 'lineno', '?'))}: {name}")
    return found


def test_only_the_settings_module_names_a_variable_in_code():
    spelled = {
        str(path.relative_to(REPO)): found
        for path in _tracked("*.py")
        if str(path.relative_to(REPO)) not in _READERS
        and (found := variable_names_defined(path.read_text()))
    }
    assert spelled == {}


@pytest.mark.parametrize(
    "line",
    [
        'os.environ.get("DELTASYNC_GATE")',
        'env = {"DELTASYNC_API_KEY": key}',
        "env = dict(os.environ, DELTASYNC_API_KEY=token)",
        'TOKEN_ENV = "DELTASYNC_API_KEY"',
    ],
)
def test_the_check_sees_each_way_to_spell_a_name(line):
    assert variable_names_defined(line) != []
    assert variable_names_defined(f'"""Set DELTASYNC_GATE=1 to gate."""\nx = {line!r}') == []


def test_the_vllm_image_serves_on_the_space_port():
    entrypoint = (REPO / "spaces" / "vllm" / "entrypoint.sh").read_text()
    assert f'--port "${{DELTASYNC_PORT:-{defaults.SPACE_PORT}}}"' in entrypoint
    assert metadata_load(REPO / "spaces" / "vllm" / "README.md")["app_port"] == defaults.SPACE_PORT
    dockerfile = (REPO / "spaces" / "vllm" / "Dockerfile").read_text()
    assert f"EXPOSE {defaults.SPACE_PORT}\n" in dockerfile


def test_the_wordle_image_sets_the_servers_defaults():
    """The image's ENV block equals the server's own defaults, the web page switched on."""
    text = WORDLE_DOCKERFILE.read_text()
    block = re.search(r"^ENV MAX_CONCURRENT_ENVS=.*?(?=^\S)", text, flags=re.M | re.S)
    assert block is not None
    values = dict(re.findall(r"(\w+)=(\S+)", block.group(0)))
    assert set(values) == {
        "MAX_CONCURRENT_ENVS",
        "SESSION_FIRST_MESSAGE_TIMEOUT_S",
        "SESSION_IDLE_TIMEOUT_S",
        "ENABLE_WEB_INTERFACE",
    }
    assert ServerSettings.from_environ(values) == ServerSettings(web=True)


WORDLE_DOCKERFILE = REPO / "wordle_env" / "server" / "Dockerfile"
