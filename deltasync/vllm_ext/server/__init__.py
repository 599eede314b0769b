"""Layer 6, the server processes: the serve parent (`serve`, `compat`, `_site`), and inside
vLLM's API server the app vLLM loads as its middleware (`app`), assembled from authentication
(`auth`), the control routes (`control`) and follow mode (`follow`). The request and response
shapes it shares with the worker and the client are `vllm_ext.protocol`.

Torch-free: the serve parent runs before vLLM is imported. May import every layer below
`vllm_ext`, `vllm_ext.protocol` and `vllm_ext.client`, and nothing of the worker side (`engine`,
`worker`, `apply`).
"""
