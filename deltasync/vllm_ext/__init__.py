"""Layer 6, vLLM 0.32 integration: a weight-transfer backend that follows a deltasync bucket.

Four processes' code, by folder: `server/` runs in the serve parent (`serve`, torch-free) and in
vLLM's API server (`app`, assembled from `auth`, `control` and `follow`); `worker`, `engine` and
`apply/` run in every vLLM worker; `client` runs in the trainer; `protocol` is the wire between
them all. May import every layer below.

Nothing here imports vLLM at package import; `deltasync.vllm_ext.worker` does, and registers the
`deltasync` backend as it loads (vLLM imports it in every worker via `--worker-extension-cls`).
`serve` and `auth` here are the stable paths of `server.serve` and `server.app`.
"""

BACKEND = "deltasync"
WORKER_EXTENSION = "deltasync.vllm_ext.worker.DeltaSyncWorkerExtension"
AUTH_MIDDLEWARE = "deltasync.vllm_ext.server.app.BearerAuthMiddleware"
LOOPBACK_MIDDLEWARE = "deltasync.vllm_ext.server.app.LoopbackMiddleware"  # --insecure-no-auth

__all__ = ["AUTH_MIDDLEWARE", "BACKEND", "LOOPBACK_MIDDLEWARE", "WORKER_EXTENSION"]
