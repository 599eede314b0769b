"""The vLLM worker extension (`--worker-extension-cls` this module's `DeltaSyncWorkerExtension`).

Importing this module (vLLM does, in every worker, before the model loads) registers the
`deltasync` weight-transfer backend. The methods below are reachable through
`POST /collective_rpc {"method": "deltasync_stage", "kwargs": {"version": "7"}}`; they are prefixed
because vLLM refuses an extension attribute that the worker already has.
"""

from __future__ import annotations

from typing import Any

from .engine import DeltaSyncEngine, register, stage_args

__all__ = ["DeltaSyncWorkerExtension"]

register()


class DeltaSyncWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _deltasync_engine(self) -> DeltaSyncEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltaSyncEngine):
            raise RuntimeError(
                "the deltasync backend is not active: start vLLM with "
                '--weight-transfer-config \'{"backend": "deltasync"}\''
            )
        return engine

    def deltasync_stage(self, version: str, path: str = "") -> dict[str, Any]:
        """Fetch, decode and validate `version` in the background while serving."""
        return self._deltasync_engine().stage(*stage_args(version, path))

    def deltasync_status(self) -> dict[str, Any]:
        """Bucket, run, version held, staging states and the last update's timings."""
        return self._deltasync_engine().status()

    def deltasync_digests(self) -> dict[str, Any]:
        """Per-tensor xxh3-128 digests of the served bf16 weights, by HF name."""
        return self._deltasync_engine().digests()
