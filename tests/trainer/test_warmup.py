"""The format warm-up: synthetic tool calls drawn from the tools' schemas, rendered as TRL's
rollout worker renders a turn, taught to a built model in a few supervised steps."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trainer.config import BUILT_CHAT
from trainer.envs.spec import preflight, resolve
from trainer.envs.warmup import (
    WARMUP_SEED,
    _common_prefix,
    sample_arguments,
    warm_up,
    warmup_examples,
)
from trainer.random_qwen3 import TOOL_CALL_PIECES, byte_level_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "color": {"type": "string", "enum": ["red", "green"]},
        "values": {"type": "array", "items": {"type": "number"}},
        "loud": {"type": "boolean"},
        "text": {"type": "string"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["a", "color", "values", "loud", "text"],
}


def test_arguments_follow_the_schema_and_the_examples():
    rng = random.Random(0)
    drawn = [sample_arguments(SCHEMA, rng, {"text": ("hello", "world")}) for _ in range(200)]
    for arguments in drawn:
        assert type(arguments["a"]) is int and 0 <= arguments["a"] <= 9
        assert arguments["color"] in ("red", "green") and type(arguments["loud"]) is bool
        assert 1 <= len(arguments["values"]) <= 3
        assert all(type(v) is float for v in arguments["values"])
        assert arguments["text"] in ("hello", "world")
        assert type(arguments.get("note", "")) is str
    assert 0.3 < sum("note" in a for a in drawn) / len(drawn) < 0.7  # optional: half the time


def test_a_tool_call_is_three_pieces_and_its_names():
    tokenizer = byte_level_tokenizer()
    body = json.dumps({"name": "guess", "arguments": {"guess": "crane"}})
    call = f"<tool_call>\n{body}\n</tool_call>"
    ids = tokenizer.encode(call, add_special_tokens=False)
    pieces = [tokenizer.convert_tokens_to_ids(p) for p in TOOL_CALL_PIECES]
    assert [i for i in ids if i in pieces] == pieces and len(ids) == 3 + len("guess") + 16
    assert tokenizer.decode(ids) == call  # ordinary tokens: decoding keeps them


def test_common_prefix_leaves_a_token_to_train_from():
    assert _common_prefix([[1, 2, 3, 4], [1, 2, 5]]) == [1, 2]
    assert _common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2]
    assert _common_prefix([[7, 1], [8, 1]]) == []


@pytest.fixture(scope="module")
def mcp_spec():
    from mcp_env import ToolEnvironment, create_mcp_app
    from say_env import serve

    with serve(create_mcp_app()) as url:
        ToolEnvironment.calls.clear()
        yield preflight(resolve(url, url))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from trainer.config import prepare_model

    path = prepare_model("tiny", str(tmp_path_factory.mktemp("model")))
    return Qwen3ForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ), AutoTokenizer.from_pretrained(path)


def test_examples_are_real_turns_on_unseen_seeds(mcp_spec, built):
    from mcp_env import ToolEnvironment, task

    _, tokenizer = built
    examples = warmup_examples(mcp_spec, tokenizer, 6, seed=1)
    assert len(examples) == 12  # the call, then the end of the turn after the reply
    for call, end in zip(examples[0::2], examples[1::2], strict=True):
        ((start, stop),) = call.spans
        text = tokenizer.decode(call.ids[start:stop])
        assert text.startswith('<tool_call>\n{"name": ') and text.endswith("</tool_call><|im_end|>")
        assert tokenizer.decode(call.ids[:start]).endswith("<|im_start|>assistant\n")
        ((start, stop),) = end.spans
        assert end.ids[start:stop] == [tokenizer.eos_token_id] and stop == len(end.ids)
        assert "<tool_response>" in tokenizer.decode(end.ids[:start])  # the server's real reply
    assert len(ToolEnvironment.calls) == 6  # each call really ran against the server
    tasks = {task(WARMUP_SEED + 6 + i)[0] for i in range(6)}  # reset seeds past the dataset's
    assert all(any(t in tokenizer.decode(e.ids) for t in tasks) for e in examples[0::2])


@pytest.mark.parametrize(("kwargs", "trained"), [(BUILT_CHAT, True), (None, False)])
def test_a_built_model_s_call_is_trained_by_grpo(mcp_spec, built, kwargs, trained):
    """TRL's own reconciler on a two-turn rollout of the call the warm-up teaches: rendered as a
    built model's rollouts are (`BUILT_CHAT`), the next turn's prompt extends what the model
    wrote and the call's tokens are trained; Qwen3's default rendering re-renders the call with
    a think block the model never wrote, and TRL keeps it as untrained context."""
    from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

    _, tokenizer = built
    examples = warmup_examples(mcp_spec, tokenizer, 3, seed=2, chat_template_kwargs=kwargs)
    for call, end in zip(examples[0::2], examples[1::2], strict=True):
        ((start, stop),) = call.spans
        written = call.ids[start:stop]
        turns = [
            TurnRecord(call.ids[:start], written, [0.0] * len(written)),
            TurnRecord(end.ids[:-1], end.ids[-1:], [0.0]),
        ]
        (row,), tally = _chain_to_sequences(turns, "rollout", fork_threshold=1024)
        assert sum(row.completion_mask) == (len(written) + 1 if trained else 1)
        assert tally["realign"] == (0 if trained else 1)


def test_the_warm_up_teaches_the_call_format(mcp_spec, built):
    model, tokenizer = built
    attention = model.config._attn_implementation
    result = warm_up(model, tokenizer, mcp_spec, steps=20, transcripts=8, lr=1e-2)
    assert result.loss_after < result.loss_before / 2, result
    assert model.config._attn_implementation == attention  # TRL's own attention is restored
    assert result.line().startswith(
        "warm-up: 20 supervised steps on 8 synthetic tool-call transcripts (add, mean, pick, shout)"
    )


@pytest.mark.parametrize(
    ("given", "built", "tools", "continued", "expected"),
    [
        (None, True, ("guess",), False, 200),  # a built model on a tool environment
        (None, False, ("guess",), False, 0),  # a real model calls tools already
        (50, False, ("guess",), False, 50),  # asked for
        (None, True, (), False, 0),  # nothing to call
        (50, True, ("guess",), True, 0),  # trained weights are continued as they are
    ],
)
def test_warm_up_steps(given, built, tools, continued, expected):
    import argparse

    from trainer.envs.spec import EnvSpec
    from trainer.publishing import OneProcess
    from trainer.train import _warmup_steps

    args = argparse.Namespace(warmup_steps=given)
    spec = EnvSpec("wordle", object, "Play.", "reward", tools)
    publishing = OneProcess(publisher=None)
    publishing.weights = object() if continued else None
    assert _warmup_steps(args, built, spec, publishing) == expected
