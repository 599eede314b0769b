"""`--env` with zero code, against real OpenEnv servers on loopback: an MCP-tool server becomes one
typed TRL tool per server tool whose calls arrive typed and whose rewards come from the server; a
TextArena server keeps the `act` tool; a session class loads from a folder outside the
repository; and whatever cannot be played is refused before training in one line."""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mcp_env import DESCRIPTION, ToolEnvironment, create_mcp_app
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import Action, Observation
from say_env import SayEnvironment, create_say_app, serve
from transformers.utils import get_json_schema

from trainer.envs.mcp_tools import ToolSpec, tool_methods
from trainer.envs.sessions import OpenEnvTextTool, WordleTool
from trainer.envs.spec import EnvSetupError, env_arg, preflight, resolve
from trainer.train import build_parser

REPO = Path(__file__).resolve().parents[2]
UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing listens


@pytest.fixture(scope="module")
def mcp_url():
    with serve(create_mcp_app()) as url:
        yield url


@pytest.fixture(scope="module")
def say_url():
    with serve(create_say_app()) as url:
        yield url


class CommandAction(Action):
    command: str
    count: int


class CommandEnvironment(SayEnvironment):
    """say_env's game behind an action that fits neither a message nor MCP tool calls."""

    def step(self, action, timeout_s=None, **_):
        return Observation(done=True, reward=0.0)


@pytest.fixture(scope="module")
def command_url():
    app = create_app(CommandEnvironment, CommandAction, Observation, env_name="command_env")
    with serve(app) as url:
        yield url


def _tools(session) -> dict:
    """What TRL's rollout worker exposes: bound public methods other than reset and get_reward."""
    return {
        name: getattr(session, name)
        for name, _ in inspect.getmembers(type(session), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def test_mcp_tools_become_typed_methods(mcp_url):
    spec = preflight(resolve(mcp_url, UNREACHABLE))
    assert spec.tools == ("add", "mean", "pick", "shout")
    assert spec.prompt.startswith(DESCRIPTION) and "(add, shout, pick, mean)" in spec.prompt
    assert spec.reward == "the sum of the server's `reward` over the episode's steps"
    schemas = {n: get_json_schema(m)["function"] for n, m in _tools(spec.factory()).items()}
    assert schemas["add"]["description"] == "Add two integers."
    assert schemas["add"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend"},
        },
        "required": ["a", "b"],
    }
    assert schemas["shout"]["parameters"]["properties"]["loud"] == {
        "type": "boolean",
        "description": "add an exclamation mark",
    }
    assert schemas["shout"]["parameters"]["required"] == ["text"]
    assert schemas["pick"]["parameters"]["properties"]["color"] == {
        "type": "string",
        "enum": ["red", "green", "blue"],
        "description": "color",
    }
    assert schemas["mean"]["parameters"]["properties"] == {
        "values": {"type": "array", "items": {"type": "number"}, "description": "the numbers"},
        "digits": {"type": "integer", "nullable": True, "description": "round to this many digits"},
    }


def test_mcp_calls_arrive_typed_and_the_server_scores_them(mcp_url):
    factory = resolve(mcp_url, UNREACHABLE).factory
    session = pickle.loads(pickle.dumps(factory))()  # as TRL's spawned rollout worker builds it
    assert pickle.loads(pickle.dumps(session)).__class__ is type(session)
    ToolEnvironment.calls.clear()
    assert session.reset(prompt=[], seed=0) == "\n\nAdd 2 and 3."
    tools = _tools(session)
    assert tools["mean"](values=[1, 2.5], digits=1) == "1.8"
    assert tools["shout"](text="hi") == "HI!"
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        tools["add"](a=2)  # refused here: nothing is sent
    with pytest.raises(RuntimeError, match="valid integer"):
        tools["add"](a="two", b=3)  # the server's refusal: TRL counts a failed call
    assert session.reward == 0.0 and not session.done  # get_reward() would end the rollout
    assert tools["add"](a=2, b=3) == "5"
    assert session.reward == 1.0 and session.done
    assert tools["pick"](color="red") == "The episode is over."
    assert ToolEnvironment.calls == [
        ("mean", {"values": [1, 2.5], "digits": 1}),
        ("shout", {"text": "hi"}),
        ("add", {"a": "two", "b": 3}),
        ("add", {"a": 2, "b": 3}),
    ]
    assert [type(v) for v in ToolEnvironment.calls[-1][1].values()] == [int, int]
    session.reset(seed=1)
    assert tools["shout"](text="hello", loud=False) == "HELLO"
    assert session.get_reward() == 0.5  # a new episode: its own reward


def test_tools_that_cannot_be_methods_are_left_out():
    specs = [
        ToolSpec("reset"),
        ToolSpec("get_reward"),
        ToolSpec("done"),
        ToolSpec("_hidden"),
        ToolSpec("odd", input_schema={"properties": {"a-b": {"type": "string"}}}),
        ToolSpec("fine", "Fine.", {"properties": {"x": {"type": "number"}}, "required": ["x"]}),
    ]
    assert list(tool_methods(tuple(specs))) == ["fine"]
    with pytest.raises(ValueError, match="needs a name"):
        ToolSpec.from_dict({"description": "no name"})


def test_textarena_servers_keep_the_act_tool(say_url):
    for env, url in (("openenv", say_url), (say_url, UNREACHABLE)):
        spec = preflight(resolve(env, url))
        assert spec.factory.func is OpenEnvTextTool and spec.factory.keywords == {
            "base_url": say_url
        }
        assert spec.tools == ("act",) and "last step" in spec.reward
    assert preflight(resolve("wordle", say_url)).factory.func is WordleTool


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_a_mismatched_action_shape_is_refused_in_one_line(command_url, mcp_url):
    with pytest.raises(EnvSetupError) as exc:
        resolve(command_url, UNREACHABLE)
    message = _one_line(exc)
    assert "{command: string, count: integer}" in message and "package.module:Class" in message
    with pytest.raises(EnvSetupError) as exc:  # Wordle's guesses sent to an MCP server
        preflight(resolve("wordle", mcp_url))
    assert 'not {"message": "hello"}' in _one_line(exc)
    with pytest.raises(EnvSetupError) as exc:
        resolve("openenv", UNREACHABLE)
    assert "answers no OpenEnv GET /schema" in _one_line(exc)


SESSIONS = '''
from trainer.envs.sessions import OpenEnvSession


class Counter:
    """TRL's environment shape, no server: counts its tool calls."""

    prompt = "Count with the tick tool."

    def reset(self, **row):
        self.ticks = 0
        return f" (seed {row.get('seed')})"

    def tick(self, by: int) -> str:
        """Count up.

        Args:
            by: how much.
        """
        self.ticks += by
        return str(self.ticks)

    def get_reward(self) -> float:
        return float(self.ticks)


class Say(OpenEnvSession):
    prompt = "Say the word with the say tool."

    def say(self, word: str) -> str:
        """Say one word.

        Args:
            word: the word.
        """
        return self._step(word)


class NoReward:
    def reset(self, **row):
        return ""


class Undocumented(Counter):
    def shout(self, text: str) -> str:
        return text


class Strict(Counter):
    def reset(self):
        return ""
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch) -> Path:
    """A package of session classes in a folder outside the repository, on sys.path as the
    trainer gets it (the current folder, or PYTHONPATH from launch.py)."""
    package = tmp_path / "userenvs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sessions.py").write_text(textwrap.dedent(SESSIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_session_class_from_outside_the_repository(user_package, say_url):
    spec = preflight(resolve("userenvs.sessions:Counter", UNREACHABLE))
    assert spec.factory.__qualname__ == "Counter" and spec.tools == ("tick",)
    assert spec.prompt == "Count with the tick tool." and spec.reward == "Counter.get_reward()"
    session = pickle.loads(pickle.dumps(spec.factory))()
    assert session.reset(seed=3) == " (seed 3)" and session.tick(by=2) == "2"
    spec = preflight(resolve("userenvs.sessions:Say", say_url))  # takes base_url: gets --env-url
    assert isinstance(spec.factory, functools.partial) and spec.tools == ("say",)
    session = spec.factory()
    assert session.reset(seed=0).strip() == "[GAME] Say the word hello."
    assert session.say("hello").strip().endswith("reward 1.0.") and session.get_reward() == 1.0


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("userenvs.missing:Counter", "no module 'userenvs.missing'"),
        ("nowhere.sessions:Counter", "no module 'nowhere'"),
        ("userenvs.sessions:Nothing", "has no class Nothing with a reset method"),
        ("userenvs.sessions:NoReward", "NoReward has no get_reward()"),
        ("userenvs.sessions:Undocumented", "tool shout cannot be shown"),
        ("userenvs.sessions:Strict", "reset failed: "),
    ],
)
def test_session_classes_that_cannot_be_played_are_one_line(user_package, ref, expected):
    with pytest.raises(EnvSetupError) as exc:
        preflight(resolve(ref, UNREACHABLE))
    assert expected in _one_line(exc)


def test_env_argument_forms():
    for ok in ("sanity", "wordle", "openenv", "https://x.hf.space", "a.b_c:D"):
        assert env_arg(ok) == ok
    for bad in ("chess", "a.b", "a:b.c", "ftp://x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--env", bad])


@pytest.mark.slow  # the trainer script's imports (torch, transformers, TRL): ~10-20 s
def test_trainer_refuses_a_mismatched_server_before_loading_anything(command_url, tmp_path):
    started = time.monotonic()
    cmd = [sys.executable, "-m", "trainer.train", "--env", command_url, "--steps", "1"]
    cmd += ["--model-dir", str(tmp_path / "model"), "--bucket", str(tmp_path / "bucket")]
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    line = result.stderr.strip().splitlines()[-1]
    print(f"refused in {elapsed:.1f}s: {line}")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert line.startswith(
        f"error: {command_url} takes actions {{command: string, count: integer}}"
    )
    assert result.stderr.count("error: ") == 1 and "package.module:Class" in line
    assert not (tmp_path / "model").exists() and not (tmp_path / "bucket").exists()
