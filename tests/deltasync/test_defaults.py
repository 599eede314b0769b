"""One block of defaults: README's table names exactly the `DELTASYNC_*` variables the parts read,
and the literals the Space images keep (a Dockerfile and a shell entrypoint cannot import Python)
agree with `deltasync.defaults`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from huggingface_hub import metadata_load

from deltasync import defaults
from wordle_env.server.settings import ServerSettings

REPO = Path(__file__).resolve().parents[2]
_VARIABLE = re.compile(r"\bDELTASYNC_[A-Z][A-Z_]*[A-Z]\b")


def _tracked(*patterns: str) -> list[Path]:
    found = subprocess.run(
        ["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / f for f in found if not f.startswith("tests/")]


def test_readme_lists_every_variable_read_and_no_other():
    sources = _tracked("*.py", "*.sh", "*Dockerfile", "spaces/*/README.md")
    read = {v for path in sources for v in _VARIABLE.findall(path.read_text())}
    readme = (REPO / "README.md").read_text()
    rows = set(re.findall(r"^\| `(DELTASYNC_\w+)` \| ", readme, flags=re.M))
    assert len(read) >= 10 and rows == read


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
