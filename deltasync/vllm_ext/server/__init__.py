"""Layer 6, the server processes: the serve parent (`serve`, `compat`, `_site`), and inside
vLLM's API server the composition root (`auth`), the control routes (`control`), follow mode
(`follow`) and the request/response shapes shared with the worker and client (`protocol`).

Torch-free: the serve parent runs before vLLM is imported. May import every layer below
`vllm_ext` and nothing of the worker side (`engine`, `worker`, `apply`).
"""
