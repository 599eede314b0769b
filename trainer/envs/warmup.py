"""A format warm-up before GRPO on an environment, for a model that cannot call tools yet.

A random built model (`--model small`) never writes a parseable tool call (about 25 tokens of
exact JSON, even with its tokenizer's tool-call pieces), so every rollout of an environment run
scores the same and GRPO has nothing to learn from. The warm-up teaches the format and nothing
else, in a few supervised steps on synthetic transcripts built from the environment itself:

- the prompt of a real first turn, rendered as TRL's rollout worker renders it (the session's
  prompt plus what a real `reset` returned, the tools' schemas, TRL's chat template), on reset
  seeds the training dataset never uses (`WARMUP_SEED` on);
- one call of a tool drawn at random, with arguments drawn from that tool's JSON schema
  (strings from the session class's `examples` when it has some), never the task's answer;
- the environment's real reply to that call, then the end of the turn.

Which tool to call for which task, and with which arguments, is left to GRPO: the warm-up's
calls are random, so what the reward gains after it is learned from the environment.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from .spec import EnvSpec, session_tools

__all__ = [
    "WARMUP_SEED",
    "WARMUP_STEPS",
    "Example",
    "WarmupResult",
    "sample_arguments",
    "warm_up",
    "warmup_examples",
]

log = logging.getLogger(__name__)

WARMUP_STEPS = 200  # the default for a built model: about a minute on 2 cores
WARMUP_SEED = 1_000_000  # first reset seed of a warm-up transcript; dataset rows use 0..4095
_WORD = (3, 8)  # length of a made-up string argument


@dataclass(frozen=True)
class Example:
    """One supervised transcript: its token ids and the spans (start, end) the model should
    write (a tool call and the end of its turn; the end of the turn after the reply). The
    rest (prompt, tools, the environment's reply) is context, not trained."""

    ids: list[int]
    spans: tuple[tuple[int, int], ...]

    @property
    def trained(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True)
class WarmupResult:
    steps: int
    transcripts: int
    tools: tuple[str, ...]
    loss_before: float  # mean negative log-likelihood per target token
    loss_after: float
    seconds: float

    def line(self) -> str:
        return (
            f"warm-up: {self.steps} supervised steps on {self.transcripts} synthetic "
            f"tool-call transcripts ({', '.join(self.tools)}), loss per token "
            f"{self.loss_before:.2f} -> {self.loss_after:.2f}, {self.seconds:.0f} s"
        )


def sample_arguments(
    schema: Mapping[str, Any], rng: random.Random, examples: Mapping[str, Sequence[Any]] = {}
) -> dict[str, Any]:
    """Arguments for a tool whose parameters `schema` describes (a JSON schema object):
    every required one, each optional one half the time; `examples[name]`, when given, is the
    pool a parameter's value is drawn from."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    arguments = {}
    for name, prop in properties.items():
        if name not in required and rng.random() < 0.5:
            continue
        pool = examples.get(name)
        arguments[name] = rng.choice(list(pool)) if pool else _value(prop, rng)
    return arguments


def _value(schema: Mapping[str, Any], rng: random.Random) -> Any:
    if schema.get("enum"):
        return rng.choice(list(schema["enum"]))
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or ["string"])
    if kind == "integer":  # small values: the format is what is taught, not the numbers
        return rng.randint(0, 9)
    if kind == "number":
        return round(rng.uniform(0, 10), 1)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(schema.get("items") or {}, rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {}
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(*_WORD)))


def _renderer(tokenizer: Any) -> tuple[Any, str | None]:
    """The tokenizer and chat template TRL's rollout worker renders turns with."""
    from trl.experimental.async_grpo import async_rollout_worker as worker

    tokenizer = worker.add_response_schema(tokenizer)
    prefix_preserving = worker.is_chat_template_prefix_preserving(tokenizer)
    return tokenizer, None if prefix_preserving else worker.get_training_chat_template(tokenizer)


def _call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call as Qwen3's template writes it and TRL's response parser reads it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def warmup_examples(
    spec: EnvSpec,
    tokenizer: Any,
    count: int,
    *,
    seed: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Example]:
    """Two examples per transcript, the call and the end of the turn after the reply, from
    `count` real sessions of `spec` reset on seeds from `WARMUP_SEED` on, rendered as the
    rollouts render them (`chat_template_kwargs`: for a built model, `trainer.config.BUILT_CHAT`).
    """
    from transformers.utils.chat_template_utils import get_json_schema

    tokenizer, template = _renderer(tokenizer)
    rng = random.Random(seed)
    end = [tokenizer.eos_token_id]
    out = []
    for i in range(count):
        session = spec.factory()
        try:
            tools = [getattr(session, name) for name in session_tools(session)]
            observation = session.reset(seed=WARMUP_SEED + seed * count + i)
            tool = rng.choice(tools)
            parameters = get_json_schema(tool)["function"].get("parameters") or {}
            arguments = sample_arguments(parameters, rng, getattr(session, "examples", {}))
            try:
                reply = str(tool(**arguments))
            except Exception as exc:  # as TRL's worker answers a failed call
                reply = str({"error": str(exc)})
        finally:
            if callable(close := getattr(session, "get_reward", None)):
                close()
        messages: list[dict[str, Any]] = [{"role": "user", "content": spec.prompt + observation}]

        def render(conversation: list[dict[str, Any]], tools=tools) -> list[int]:
            return tokenizer.apply_chat_template(
                conversation,
                return_dict=False,
                add_generation_prompt=True,
                tools=tools,
                chat_template=template,
                **(chat_template_kwargs or {}),
            )

        call = tokenizer.encode(_call_text(tool.__name__, arguments), add_special_tokens=False)
        first = render(messages) + call + end
        function = {"name": tool.__name__, "arguments": arguments}
        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": function}],
            },
            {"role": "tool", "name": tool.__name__, "content": reply},
        ]
        second = render(messages)
        out.append(Example(first, ((len(first) - len(call) - 1, len(first)),)))
        out.append(Example(second + end, ((len(second), len(second) + 1),)))
    return out


def _loss(model: torch.nn.Module, examples: Sequence[Example]) -> torch.Tensor:
    """Summed negative log-likelihood of the examples' trained spans.

    What precedes the spans is context (the tools' schemas, the task, a reply: over 1000 tokens
    against about 25 trained). It runs without gradients: the part every example shares once,
    then each example's own rest from a copy of that key/value cache, so a step costs about
    its trained tokens; the context's encoding is then trained only through the spans'
    attention to it. The last context token runs with the spans: its logits predict the first."""
    starts = [e.spans[0][0] - 1 for e in examples]
    shared = _common_prefix([e.ids[:s] for e, s in zip(examples, starts, strict=True)])
    device = model.device
    common = DynamicCache(config=model.config)
    if shared:
        with torch.no_grad():
            model(input_ids=torch.tensor([shared], device=device), past_key_values=common)
    total = torch.zeros((), device=device)
    for example, start in zip(examples, starts, strict=True):
        cache = copy.deepcopy(common)
        ids = torch.tensor([example.ids], device=device)
        if start > len(shared):
            with torch.no_grad():
                model(input_ids=ids[:, len(shared) : start], past_key_values=cache)
        logits = model(input_ids=ids[:, start:], past_key_values=cache).logits[0]
        for first, end in example.spans:  # logits[j] predicts token start + 1 + j
            predicted = logits[first - start - 1 : end - start - 1].float()
            target = ids[0, first:end]
            total = total + torch.nn.functional.cross_entropy(predicted, target, reduction="sum")
    return total


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    """The longest prefix of all `sequences`, at least one token shorter than the shortest."""
    shortest = min(len(s) for s in sequences) - 1
    for i in range(shortest):
        if any(s[i] != sequences[0][i] for s in sequences):
            return list(sequences[0][:i])
    return list(sequences[0][:shortest])


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    spec: EnvSpec,
    *,
    steps: int,
    lr: float = 5e-3,
    transcripts: int = 128,
    batch: int = 8,
    seed: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> WarmupResult:
    """Train `model` in place for `steps` AdamW steps of `batch` transcripts rendered with
    `chat_template_kwargs`, as the rollouts render them."""
    started = time.monotonic()
    examples = warmup_examples(
        spec, tokenizer, transcripts, seed=seed, chat_template_kwargs=chat_template_kwargs
    )
    calls, ends = examples[0::2], examples[1::2]
    rng = random.Random(seed)

    def draw() -> list[Example]:  # ending a turn is one easy token: a quarter as many of those
        return rng.sample(calls, min(batch, len(calls))) + rng.sample(ends, max(1, batch // 4))

    probe = draw()
    was_training = model.training
    # TRL set its tree-packed attention, which wants packing metadata: plain SDPA meanwhile
    attention, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with torch.no_grad():
        before = _loss(model, probe).item() / sum(e.trained for e in probe)
    for step in range(steps):
        chosen = draw()
        loss = _loss(model, chosen) / sum(e.trained for e in chosen)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log.info("warm-up step %d/%d: loss per token %.3f", step, steps, loss.item())
    with torch.no_grad():
        after = _loss(model, probe).item() / sum(e.trained for e in probe)
    model.train(was_training)
    model.config._attn_implementation = attention
    tools = tuple(spec.tools)
    return WarmupResult(steps, transcripts, tools, before, after, time.monotonic() - started)
