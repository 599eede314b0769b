"""`python -m deltasync check`: does a replica serve what a fresh load of the bucket's version
serves? For any model family, including ones outside the verified matrix.

- A live replica (`--replica URL`): the version it reports is exported from the bucket
  (`deltasync export`, its full-state digest verified), loaded into a new vLLM engine
  (`reference.ReferenceEngine`), and both are asked for the logprob of every token of one fixed
  prompt (greedy). They must be identical floats: any mapping error in the replica - a swapped
  expert, a misplaced shard, a stale module - moves them.
- A model folder (`--folder DIR`, e.g. a checkpoint a replica or a job wrote): its tensors must
  have the version's checkpoint names and bytes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from deltasync.errors import DeltaSyncError
from deltasync.store import Store
from deltasync.tools.export.version import export
from deltasync.tools.reference import ReferenceEngine, fixed_prompt
from deltasync.vllm_ext.client import ReplicaClient
from deltasync.wire.digests import tensor_digest

__all__ = ["check_folder", "check_replica"]


def check_replica(
    store: Store, url: str, token: str | None, *, model: str | None = None
) -> list[str]:
    """Compare a live replica with a fresh load of the version it serves; returns report lines.

    Raises:
        DeltaSyncError: the replica serves nothing yet, or its logprobs differ.
    """
    client = ReplicaClient(url, token, timeout_s=300)
    try:
        version = int(client.weight_version())
    except ValueError:
        raise DeltaSyncError(f"{url} serves no verified version yet") from None
    with tempfile.TemporaryDirectory(prefix="deltasync-check-") as scratch:
        folder = Path(scratch) / f"v{version}"
        lines = export(store, version=version, model=model, out=str(folder))
        config = json.loads((folder / "config.json").read_text())
        vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
        prompt = fixed_prompt(vocab)
        with ReferenceEngine(Path(scratch) / "reference.log") as reference:
            want = reference.logprobs(folder, prompt)
    served = client.prompt_logprobs(prompt)
    differ = [i for i, (a, b) in enumerate(zip(served, want, strict=True)) if a != b]
    if differ:
        worst = max(abs(served[i] - want[i]) for i in differ)
        raise DeltaSyncError(
            f"{url} at version {version} does NOT serve what a fresh load of it serves: "
            f"logprobs differ at {len(differ)} of {len(want)} prompt tokens (by up to {worst:.4g})"
        )
    return [
        *lines[:1],
        f"{url} serves version {version} exactly as a fresh vLLM load of it: {len(want)} prompt "
        "logprobs identical",
    ]


def check_folder(
    store: Store, folder: str, *, version: int | None = None, model: str | None = None
) -> list[str]:
    """Compare a model folder's tensors with the bucket's version (default: the latest).

    Raises:
        DeltaSyncError: names or bytes differ (the first few named).
    """
    from safetensors import safe_open

    def digests(path: Path) -> dict[str, str]:
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                out.update((name, tensor_digest(f.get_tensor(name))) for name in f.keys())  # noqa: SIM118
        if not out:
            raise DeltaSyncError(f"no *.safetensors in {path}")
        return out

    with tempfile.TemporaryDirectory(prefix="deltasync-check-") as scratch:
        lines = export(store, version=version, model=model, out=str(Path(scratch) / "v"))
        want = digests(Path(scratch) / "v")
    found = digests(Path(folder))
    wrong = sorted(n for n in set(want) | set(found) if want.get(n) != found.get(n))
    if wrong:
        raise DeltaSyncError(
            f"{folder} differs from the bucket's version in {len(wrong)} of {len(want)} tensors "
            f"(missing, extra or other bytes): {wrong[:5]}"
        )
    return [*lines[:1], f"{folder} holds the version's {len(want)} tensors bit for bit"]
