"""Random models for tests and benchmarks, built offline from transformers' config classes
(nothing from the Hub), one module per kind of model:

- `qwen3`: Qwen3 at real shapes (`SHAPES`: 0.6B, 1.7B, 100M, tiny) for the benchmarks, and the
  tests' small in-memory Qwen3s;
- `families`: a tiny checkpoint of every model family the project verifies on vLLM;
- `vllm_layout`: a stand-in holding a Qwen3 in vLLM's fused layout (for sinks without vLLM).

The local run's own models (`--model tiny`/`small`) are the product's: `trainer.random_qwen3`.
"""
