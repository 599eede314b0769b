"""Swapping the environment as the README's "Use another OpenEnv environment" says: its example
class is valid as TRL reads tools, a class written by that recipe plays a second, real OpenEnv
server (`say_env`) through a TRL-shaped tool loop with rewards, and registering it in
`ENVIRONMENTS` makes it a `--env` of the trainer with its own prompt (`--env package.module:Class`
needs no registration: tests/trainer/test_env_spec.py)."""

from __future__ import annotations

import functools
import inspect
import pickle
import re
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from trainer import envs
from trainer.envs.sessions import ENVIRONMENTS, OpenEnvSession
from trainer.envs.spec import resolve
from trainer.train import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _tools(session: OpenEnvSession) -> dict:
    """What TRL's rollout worker exposes: bound public methods other than reset and get_reward."""
    return {
        name: getattr(session, name)
        for name, _ in inspect.getmembers(type(session), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def _readme_example() -> type[OpenEnvSession]:
    section = README.read_text().split("### Use another OpenEnv environment", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    namespace = {"OpenEnvSession": OpenEnvSession}
    exec(code, namespace)
    (cls,) = (v for v in namespace.values() if isinstance(v, type) and v is not OpenEnvSession)
    return cls


class SayTool(OpenEnvSession):
    """Written by the README's recipe for `say_env` (which `--env openenv` could also play)."""

    prompt = "Say the word the game asks for with the say tool."

    def _action(self, text: str) -> dict:
        return {"message": text.strip()}

    def _text(self, observation: dict) -> str:
        return observation["messages"][0]["content"].strip().splitlines()[-1]

    def say(self, word: str) -> str:
        """Say one word.

        Args:
            word: the word to say.

        Returns:
            What the game answered.
        """
        return self._step(word)


def test_readme_example_is_what_trl_reads():
    cls = _readme_example()
    tools = _tools(cls(base_url="http://127.0.0.1:1"))
    assert list(tools) == ["move"] and "move tool" in cls.prompt
    schema = get_json_schema(tools["move"])["function"]
    assert schema["name"] == "move" and schema["parameters"]["required"] == ["move"]


def test_registered_envs_prompts_name_their_tools():
    for name, cls in ENVIRONMENTS.items():
        tools = _tools(cls(base_url="http://127.0.0.1:1"))
        assert tools, name
        assert all(f"{tool} tool" in cls.prompt for tool in tools), (name, cls.prompt)


def test_registering_makes_a_trainer_env(monkeypatch):
    monkeypatch.setitem(envs.ENVIRONMENTS, "say", SayTool)
    args = build_parser().parse_args(["--env", "say", "--env-url", "http://127.0.0.1:1"])
    spec = resolve(args.env, args.env_url)  # what the trainer plays, after its pre-flight
    assert isinstance(spec.factory, functools.partial) and spec.factory.func is SayTool
    assert spec.prompt == SayTool.prompt and spec.factory().base_url == "http://127.0.0.1:1"


@pytest.mark.slow
def test_recipe_class_plays_a_second_openenv_server():
    from say_env import create_say_app, serve

    with serve(create_say_app()) as url:
        rewards = {}
        for seed, word in ((0, "hello"), (1, "hello")):
            # TRL: build in the trainer, pickle into the rollout process, reset with the row
            session = pickle.loads(pickle.dumps(functools.partial(SayTool, base_url=url)()))
            tools = _tools(session)
            assert list(tools) == ["say"]
            schema = get_json_schema(tools["say"])["function"]
            assert schema["parameters"]["properties"]["word"]["type"] == "string"
            intro = session.reset(prompt=[{"role": "user", "content": SayTool.prompt}], seed=seed)
            assert intro == f"[GAME] Say the word {('hello', 'world')[seed]}."
            answer = tools["say"](**{"word": word})  # arguments as parsed from the tool call
            assert answer.startswith(f"[GAME] You said '{word}'") and session.done
            assert tools["say"](word) == "The game is over."
            rewards[seed] = session.get_reward()
    assert rewards == {0: 1.0, 1: 0.0}
