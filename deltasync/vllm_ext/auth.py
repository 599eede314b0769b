"""The middleware paths vLLM was given before the server moved into `vllm_ext/server/`
(`--middleware deltasync.vllm_ext.auth.BearerAuthMiddleware` keeps working)."""

from deltasync.vllm_ext.server.app import BearerAuthMiddleware, LoopbackMiddleware

__all__ = ["BearerAuthMiddleware", "LoopbackMiddleware"]
