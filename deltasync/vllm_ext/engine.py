"""The `deltasync` weight-transfer engine for vLLM 0.32: follow a bucket of anchors and deltas.

Registered with `WeightTransferEngineFactory` when `deltasync.vllm_ext.worker` is imported. Life
of one version, driven by the sync route (`control.ControlPlane.sync`, in the API server process):

1. `stage(version, path, manifest)` starts a background download, decode and digest check (and on
   CPU the packing of touched modules) while the model serves; the route waits until it settled.
   A named `path` that is the next delta is read beside the manifest (one round trip); a
   follower's `manifest` bytes are planned from without reading them again;
2. inside the route's pause, `update_weights({"version": v})` takes that staging (or stages now)
   and commits it; the route then records the version this engine reports holding.

A replica further behind (or empty, at bootstrap) replays the bucket's chain up to `version`.

Under tensor parallelism every worker runs this engine on its own slice of each tensor (its
boxes read off its own loaders, `layout.LayoutOf`): it stages alone, then in
`update_weights` the workers exchange their shares of each version's full-state digest over
vLLM's TP CPU group, and each applies only once the shares add up to the digest the version
promises (and the boxes tile every tensor).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from deltasync import defaults, settings
from deltasync.codec.virtual import SourcePolicy
from deltasync.errors import DeltaSyncError, DigestMismatch, FormatError
from deltasync.kernels.boxes import Boxes, check_cover
from deltasync.replica.driven import plan_sync
from deltasync.replica.replay import fetch_all
from deltasync.replica.replica import Replica, StagedUpdate
from deltasync.replica.sinks import Shapes
from deltasync.store import Store, open_store
from deltasync.vllm_ext.apply.inplace import InPlaceSink
from deltasync.vllm_ext.apply.layout import LayoutOf
from deltasync.vllm_ext.apply.shadow import ShadowSink, vllm_reloader
from deltasync.vllm_ext.apply.swap import CpuGemmSwapper
from deltasync.vllm_ext.protocol import InitInfo, UpdateInfo, parse_message
from deltasync.wire.digests import StateDigest, tensor_digest, total
from deltasync.wire.manifest import ChainEntry, fetch_entry

__all__ = ["MAX_STAGED", "DeltaSyncEngine"]

log = logging.getLogger(__name__)
MAX_STAGED = 4  # staging slots kept at once (the trainer needs one or two)


@dataclass(frozen=True)
class _Staged:
    """Files downloaded and staged (`update`) to reach `target` from state `base`; `read`: the
    bytes this worker read for it (its boxes of an anchor, whole deltas)."""

    base: tuple[str | None, int | None]
    target: int
    entries: list[ChainEntry]
    bytes: int
    update: StagedUpdate
    seconds: float
    read: int


class DeltaSyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    """Applies bucket versions to the served model through one `Replica`: its sink writes in
    place on GPU (`InPlaceSink`) and through a shadow on CPU (`ShadowSink`)."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any):
        super().__init__(config, vllm_config, device, model)
        self.store: Store | None = None
        self.info: InitInfo | None = None
        self.state: Replica | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltasync-stage")
        self._staging: dict[int, Future[_Staged]] = {}
        self._draining: list[Future[_Staged]] = []  # evicted while running: still read state
        self._share: Future[dict[str, Any]] | None = None  # the latest `state_share` pass
        self._lock = threading.Lock()
        self.last_update: dict[str, Any] = {}
        if (size := self.parallel_config.pipeline_parallel_size) != 1:
            raise FormatError(f"deltasync supports pipeline parallel size 1; found {size}")
        self.tp_size = self.parallel_config.tensor_parallel_size
        # where vLLM's loaders put checkpoint tensors on this worker (read off a meta twin of
        # the served model, so nothing it serves with is touched)
        self._layout = LayoutOf(model, vllm_config, tp=_tp_position(self.tp_size))
        self.unsupported = unsupported_serving(vllm_config)

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return parse_message(InitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return parse_message(UpdateInfo, update_dict, "update_info")

    def init_refusal(self, init_info: InitInfo) -> str | None:
        """Why `init_info` may not replace the current one (None: it may). Once a bucket is
        followed, only `prepack` and `recompute_every` may change: a bootstrapped replica is
        never re-pointed at another bucket, nor made to skip verification or accept legacy
        files."""
        if self.unsupported is not None:
            return self.unsupported
        current = self.info
        if current is None:
            return None
        if not _same_bucket(current.bucket, init_info.bucket):
            return (
                f"this replica follows {current.bucket}; it cannot be pointed at "
                f"{init_info.bucket} (restart it with the other --bucket)"
            )
        for name in ("verify", "allow_legacy"):
            if getattr(current, name) != getattr(init_info, name):
                return f"{name} is {getattr(current, name)} for this replica and cannot change"
        return None

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Open the bucket (credentials come from this process's environment)."""
        if refusal := self.init_refusal(init_info):
            raise FormatError(refusal)
        self.store = open_store(init_info.bucket)
        self.info = init_info
        if self.state is None:
            self.state = Replica(
                self._make_sink(),
                allow_legacy=init_info.allow_legacy,
                verify=init_info.verify,
                recompute_every=init_info.recompute_every,
                # virtual anchors only from this replica's own model (and --source-root)
                sources=SourcePolicy.for_model(
                    self.vllm_config.model_config.model, settings.SOURCE_ROOTS.read()
                ),
            )
        if isinstance(self.state.sink, ShadowSink):
            self.state.sink.prepack = init_info.prepack
        log.info("deltasync: following %s (%s)", init_info.bucket, type(self.state.sink).__name__)

    def _make_sink(self) -> ShadowSink | InPlaceSink:
        if self.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            reload = vllm_reloader(self.model, self.vllm_config)
            if self.tp_size > 1:
                return ShadowSink(reload, self._layout, boxes_of=self._boxes_of)
            swapper = CpuGemmSwapper(self.model, self._layout, dispatch_cpu_unquantized_gemm)
            return ShadowSink(reload, self._layout, swapper=swapper)
        rank = None if self.tp_size == 1 else self._layout.tp[0]
        return InPlaceSink(self.model, self._layout, tp_rank=rank)

    def _boxes_of(self, shapes: Shapes) -> Boxes:
        """This worker's box of each tensor of a model of `shapes` (read off its loaders)."""
        return {n: p.box for n, p in self._layout(shapes).exact().items()}

    # -- staging (while serving) ----------------------------------------------------------------

    def stage(
        self, version: int, path: str | None = None, manifest: bytes | None = None
    ) -> dict[str, Any]:
        """Start fetching, decoding and validating `version` in the background (idempotent).

        `path` (the file the trainer named) is read beside the manifest when it is the next
        delta; `manifest` (bytes a follower's poll read) is planned from instead of reading the
        manifest again (`replica.driven.plan_sync`, which checks both as always).

        A slot that failed, was cancelled, or was staged from a state this replica no longer
        holds is submitted again, so an error is never replayed; `_evict` drops stale slots."""
        store, state = self._ready()
        with self._lock:
            self._evict(keep=version)
            future = self._staging.get(version)
            if future is None or not _usable(future, (state.run_id, state.version)):
                self._staging.pop(version, None)  # a new slot goes last (the newest)
                self._staging[version] = self._pool.submit(
                    self._stage_now, store, state, version, path, manifest
                )
        return self.status()

    def _evict(self, keep: int | None = None) -> None:
        """Drop slots at or below the held version, then the oldest past `MAX_STAGED` (lock
        held). A running one cannot stop: it drains, and `_settled_take` waits for it too."""
        held = self.state.version if self.state is not None else None
        stale = [v for v in self._staging if v != keep and held is not None and v <= held]
        others = [v for v in self._staging if v != keep and v not in stale]
        stale += others[: max(0, len(others) - (MAX_STAGED - 1))]
        for version in stale:
            future = self._staging.pop(version)
            if not future.cancel() and not future.done():
                self._draining.append(future)
        self._draining = [f for f in self._draining if not f.done()]

    def _stage_now(
        self, store: Store, state: Replica, target: int, path: str | None, manifest: bytes | None
    ) -> _Staged:
        started, read_before = time.perf_counter(), store.bytes_read
        base = (state.run_id, state.version)
        # the (whole) shapes held bound the sizes the manifest may declare, before any read
        shapes = state.sink.shapes()
        held = state.state_digest
        digest = held and held.hex()
        planned = plan_sync(
            store, base, target, digest=digest, shapes=shapes, path=path, manifest=manifest
        )
        if planned is None:
            raise FormatError(f"bucket {store.url} has no manifest yet")
        # an anchor is read in pieces as it is decoded: a worker holding boxes reads theirs only
        fetch = functools.partial(fetch_entry, shapes=shapes)
        entries = planned.entries
        update = state.stage(fetch_all(store, entries, planned.fetch(fetch)))
        size = sum(e.bytes for e in entries)
        seconds, read = time.perf_counter() - started, store.bytes_read - read_before
        return _Staged(base, target, entries, size, update, seconds, read)

    def _take(self, info: UpdateInfo) -> _Staged:
        """The staging of `info.version` if it is still valid, else a fresh one (inline)."""
        store, state = self._ready()
        with self._lock:
            future = self._staging.pop(info.version, None)
        if future is not None:
            try:
                staged = future.result(timeout=defaults.STAGE_TIMEOUT_S)
            except DeltaSyncError as exc:
                log.warning("deltasync: staging of %d failed (%s); retrying", info.version, exc)
            else:
                if staged.base == (state.run_id, state.version):
                    return staged
        return self._stage_now(store, state, info.version, info.path, None)

    def _settled_take(self, info: UpdateInfo) -> _Staged:
        """`_take` once no background work reads the state any more (it is about to change)."""
        self._ready()
        self.settle()
        return self._take(info)

    def settle(self) -> None:
        """Wait until no staging or share pass on the staging thread reads the held state."""
        with self._lock:
            pending = self._background()
        for future in pending:
            if not future.cancelled():
                future.exception(timeout=defaults.STAGE_TIMEOUT_S)

    def _background(self) -> list[Future]:
        """The staging thread's work that reads the held state (lock held)."""
        share = [] if self._share is None else [self._share]
        return [*self._staging.values(), *self._draining, *share]

    def _take_with_workers(self, info: UpdateInfo) -> tuple[_Staged, list[StateDigest] | None]:
        """`_take` on every TP worker, then the exchange of their digest shares (and, with an
        anchor, of their boxes); every worker reaches the same verdict, so all apply or none.

        Every worker reaches the exchange whatever happens before it (its error is its answer).
        Workers found holding different versions (one failed inside an apply the others
        completed) all forget theirs, so the next update replays from an anchor on every one;
        a combined digest that differs does the same (`receive_weights`), as a worker's held
        bytes may have drifted.
        """
        from vllm.distributed import get_tp_group

        staged: _Staged | None = None
        held: tuple[str | None, int | None] = (None, None)
        try:
            state = self._ready()[1]
            held = (state.run_id, state.version)
            staged = self._settled_take(info)
            boxes = None
            if anchors := [f.meta for f in staged.update.files if f.meta.kind == "anchor"]:
                shapes = {n: e.shape for n, e in anchors[-1].tensors.items()}
                boxes = (shapes, state.sink.boxes(shapes))
            partials = [p.hex() for p in staged.update.partials]
            mine: tuple[str | None, list[str], Any, Any] = (None, partials, boxes, held)
        except Exception as exc:  # the others wait for this worker's answer either way
            mine = (f"{type(exc).__name__}: {exc}", [], None, held)
        group = get_tp_group()
        found: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(found, mine, group=group.cpu_group)
        if any(bases != found[0][3] for *_, bases in found):
            if self.state is not None:
                self.state.forget()
            raise DeltaSyncError(
                f"TP workers held different versions {[b for *_, b in found]}; every worker "
                "replays from an anchor at the next update"
            )
        for rank, (error, *_) in enumerate(found):
            if error:
                raise DeltaSyncError(
                    f"TP worker {rank} could not stage version {info.version}: {error}"
                )
        assert staged is not None
        layouts = [layout for _, _, layout, _ in found]
        if any(layout is not None for layout in layouts):
            if any(layout is None for layout in layouts):
                raise DeltaSyncError("TP workers staged different updates")
            check_cover([boxes for _, boxes in layouts], layouts[0][0])
        shares = [[StateDigest.parse(h) for h in partials] for _, partials, *_ in found]
        if any(len(s) != len(shares[0]) for s in shares):
            raise DeltaSyncError("TP workers staged different updates")
        if not shares[0]:
            return staged, None  # nothing to verify (verification off or nothing to apply)
        return staged, [total(list(files)) for files in zip(*shares, strict=True)]

    # -- the update session --------------------------------------------------------------------

    def start_weight_update(self) -> None:
        self._ready()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Apply one version; overridden because the base class synchronizes an accelerator,
        which raises on CPU."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Apply (verified) every file up to `update_info.version`; on error nothing changes."""
        started = time.perf_counter()
        if self.tp_size > 1:
            staged, combined = self._take_with_workers(update_info)
        else:
            staged, combined = self._settled_take(update_info), None
        state = self._ready()[1]
        committing = time.perf_counter()
        try:
            applied = state.commit(staged.update, combined)
        except DigestMismatch:
            if combined is not None:  # one worker's held bytes may have drifted: all reload
                state.forget()
            raise
        self.last_update = {
            "version": update_info.version,
            "applied": applied,
            "files": [e.label for e in staged.entries],
            "bytes": staged.bytes,
            "bytes_read": staged.read,  # this worker's
            "stage_s": round(staged.seconds, 4),
            "apply_s": round(time.perf_counter() - started, 4),
            "commit_s": round(time.perf_counter() - committing, 4),
            "swapped": getattr(state.sink, "last_swapped", False),
        }
        with self._lock:
            self._evict()
        log.info("deltasync: now at version %s (%s)", state.version, self.last_update)

    def finish_weight_update(self) -> None:
        """Nothing left to do: `update_weights` applied and verified everything."""

    def shutdown(self) -> None:
        with self._lock:
            for future in self._background():
                future.cancel()
            self._staging.clear()

    # -- inspection ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        state = self.state
        with self._lock:
            staging = {str(v): _future_state(f) for v, f in sorted(self._staging.items())}
            busy = any(not f.done() for f in self._background())
        digest = None if state is None else state.state_digest
        return {
            "bucket": self.info.bucket if self.info else None,
            "path": None if state is None else type(state.sink).__name__,
            "run_id": None if state is None else state.run_id,
            "version": None if state is None else state.version,
            "state_digest": digest and digest.hex(),  # of the held version, as its files promised
            "staging": staging,
            "busy": busy,  # staging or a share pass runs (the sync route pauses once none does)
            "bytes_read": None if self.store is None else self.store.bytes_read,  # this worker's
            "last_update": self.last_update,
        }

    def state_share(self, *, start: bool = False) -> dict[str, Any]:
        """This worker's share of the full-state digest over what it holds (all of it when it
        holds whole tensors); TP workers' shares add up to the state's digest.

        The pass runs on the staging thread, not in the worker's busy loop, where it would
        stall generation: `start` begins one (unless one runs), otherwise the latest is read
        (one begins when none is for the version held); `pending` until it is done. A pass
        reads the version it reports: an update waits for it (`settle`)."""
        _, state = self._ready()
        held = {"run_id": state.run_id, "version": state.version}
        if state.version is None:
            return held | {"share": None, "pending": False}
        with self._lock:
            future = self._share
            if future is None or (future.done() and (start or not _answers(future, held))):
                future = self._share = self._pool.submit(_share_now, state)
        if not future.done():
            return held | {"share": None, "pending": True}
        return future.result() | {"pending": False}

    def before_sleep(self, *, weights_kept: bool) -> None:
        """vLLM is about to sleep (or discard what sleeps): nothing on the staging thread may
        read the weights meanwhile, and once the weights are discarded (sleep level 2) this
        replica holds no known version, so the next update starts from an anchor. Level 1
        offloads them to the host and restores them: the version stays."""
        self.settle()
        if weights_kept or self.state is None or self.state.version is None:
            return
        log.warning(
            "deltasync: vLLM discards the weights of version %s; the next update reloads an anchor",
            self.state.version,
        )
        self.state.forget()

    def digests(self) -> dict[str, Any]:
        """Per-tensor digests of the weights this worker serves (HF names, bf16 bytes); under
        tensor parallelism of its boxes, whose `boxes` (`Box.to_json`) it reports too."""
        _, state = self._ready()
        boxes = state.sink.boxes(state.sink.shapes()) if state.version is not None else None
        return {
            "run_id": state.run_id,
            "version": state.version,
            "source": "parameters" if isinstance(state.sink, InPlaceSink) else "shadow",
            "digests": state.digests(),
            "boxes": None if boxes is None else {n: b.to_json() for n, b in boxes.items()},
        }

    def engine_digests(self) -> dict[str, Any]:
        """Digests of this worker's parameters as the engine computes with them (vLLM names,
        raw bytes after its post-load processing: fused, padded, prepacked), and the version
        held: two servers with the same flags holding the same version must report the same,
        whether one synced to it and the other loaded it from a folder."""
        digests = {n: tensor_digest(p.data.cpu()) for n, p in self.model.named_parameters()}
        return {"version": None if self.state is None else self.state.version, "digests": digests}

    def _ready(self) -> tuple[Store, Replica]:
        if self.store is None or self.state is None:
            raise FormatError(
                'call /init_weight_transfer_engine {"init_info": {"bucket": URL}} first'
            )
        return self.store, self.state


def _future_state(future: Future) -> str:
    if not future.done():
        return "running"
    if future.cancelled():
        return "cancelled"
    exc = future.exception()
    return "ready" if exc is None else f"failed: {type(exc).__name__}: {exc}"


def _share_now(state: Replica) -> dict[str, Any]:
    """A share pass (on the staging thread) and the (run, version) it read."""
    held = {"run_id": state.run_id, "version": state.version}
    return held | {"share": total(list(state.sink.state_sums().values())).hex()}


def _answers(future: Future[dict[str, Any]], held: dict[str, Any]) -> bool:
    """A finished share pass that answers for `held`: one over that (run, version), or one
    that failed (its error is the answer); not one that was cancelled."""
    if future.cancelled():
        return False
    if future.exception() is not None:
        return True
    return {n: future.result()[n] for n in held} == held


def _usable(future: Future[_Staged], held: tuple[str | None, int | None]) -> bool:
    """A slot worth keeping: still running, or ready for the state held now."""
    if not future.done():
        return True
    if future.cancelled() or future.exception() is not None:
        return False
    return future.result().base == held


def _same_bucket(a: str, b: str) -> bool:
    """The same store URL (a folder however it is spelled; other URLs up to a trailing '/')."""

    def key(url: str) -> str:
        if "://" not in url or url.startswith("file://"):
            return "file://" + os.path.realpath(url.removeprefix("file://"))
        return url.rstrip("/")

    return key(a) == key(b)


def _tp_position(size: int) -> tuple[int, int]:
    """This worker's tensor-parallel (rank, size)."""
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


def unsupported_serving(vllm_config: Any) -> str | None:
    """Why this server cannot take bf16 deltas (None: it can). Quantized weights are not the
    bytes the bucket holds, LoRA wraps the layers the loaders write; experts spread over the
    engines of data parallelism, or moved at run time by load balancing, are not where the
    workers' layouts put them."""
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if quantization or getattr(vllm_config, "quant_config", None) is not None:
        return (
            f"deltasync applies bf16 weights; this server quantizes them ({quantization}: "
            "--quantization or a quantized checkpoint); serve the model unquantized"
        )
    if getattr(vllm_config, "lora_config", None) is not None:
        return "deltasync applies full weights; this server has --enable-lora; start it without"
    parallel = vllm_config.parallel_config
    if parallel.enable_expert_parallel and parallel.data_parallel_size > 1:
        return (
            "deltasync places experts over the workers of one engine; this server has "
            f"--enable-expert-parallel over {parallel.data_parallel_size} data-parallel "
            "engines: serve with --tensor-parallel-size and --enable-expert-parallel alone"
        )
    if getattr(parallel, "enable_eplb", False):
        return (
            "deltasync places each expert where vLLM's expert map put it at start; this server "
            "has --enable-eplb, which moves experts while serving: start it without"
        )
    return None
