"""vLLM 0.32 integration: a weight-transfer backend that follows a deltasync bucket.

Nothing here imports vLLM at package import; `deltasync.vllm_ext.worker` does, and registers the
`deltasync` backend as it loads (vLLM imports it in every worker via `--worker-extension-cls`).
"""

BACKEND = "deltasync"
WORKER_EXTENSION = "deltasync.vllm_ext.worker.DeltaSyncWorkerExtension"
AUTH_MIDDLEWARE = "deltasync.vllm_ext.server.auth.BearerAuthMiddleware"
LOOPBACK_MIDDLEWARE = "deltasync.vllm_ext.server.auth.LoopbackMiddleware"  # --insecure-no-auth

__all__ = ["AUTH_MIDDLEWARE", "BACKEND", "LOOPBACK_MIDDLEWARE", "WORKER_EXTENSION"]
