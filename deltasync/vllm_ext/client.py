"""HTTP client for one rollout server running the `deltasync` backend (standard library only).

Used by the launcher's bootstrap, the trainer's weight transfer and the tests:

    client = ReplicaClient("http://127.0.0.1:8001", token=os.environ["DELTASYNC_API_KEY"])
    client.init("/tmp/bucket")
    client.sync_to(7, path="runs/r/deltas/00000007-....safetensors")
    assert client.weight_version() == "7"

Weights change only through `sync_to`, one `POST /deltasync/sync` that the server runs in process
(stage, pause, apply, verify, record, resume; `control`); the other calls read or prefetch.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from deltasync.errors import DeltaSyncError, FormatError
from deltasync.vllm_ext.protocol import SYNC_PATH, merge_statuses
from deltasync.wire.digests import StateDigest, total

__all__ = ["ReplicaClient", "ReplicaError"]


class ReplicaError(DeltaSyncError):
    """A rollout server refused a request or failed it (status and body kept)."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str = ""):
        super().__init__(f"{message} ({url}{f', HTTP {status}' if status else ''}): {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


class ReplicaClient:
    """Drives one server: the sync route, the read-only `deltasync_*` RPCs, completions.

    Args:
        base_url: e.g. `http://127.0.0.1:8001` or `https://user-space.hf.space`.
        token: bearer token (the server's DELTASYNC_API_KEY), None for an open local server.
        timeout_s: per-request timeout.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def request(
        self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None
    ) -> Any:
        """One JSON request; returns the decoded body (None when empty)."""
        url = self.base_url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise ReplicaError(
                f"{method} {path} failed", url=url, status=exc.code, body=text
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ReplicaError(f"{method} {path} unreachable", url=url, body=str(exc)) from exc
        except http.client.HTTPException as exc:  # e.g. the server died mid-response
            raise ReplicaError(f"{method} {path} broke off", url=url, body=repr(exc)) from exc
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            text = raw[:500].decode(errors="replace")
            raise ReplicaError(f"{method} {path} answered no JSON", url=url, body=text) from None

    # -- state -------------------------------------------------------------------------------

    def healthy(self) -> bool:
        try:
            self.request("GET", "/health")
        except ReplicaError:
            return False
        return True

    def weight_version(self) -> str:
        return str(self.request("GET", "/weight_info")["weight_version"])

    def rpc_all(self, method: str, **kwargs: str) -> list[Any]:
        """`/collective_rpc` on every worker; every worker's result (tensor-parallel ranks)."""
        out = self.request("POST", "/collective_rpc", {"method": method, "kwargs": kwargs})
        return (out or {}).get("results") or [None]

    def status(self) -> dict[str, Any]:
        """Every worker's status, merged (`protocol.merge_statuses`)."""
        return self._merged(self.rpc_all("deltasync_status"))

    def _merged(self, results: list[Any]) -> dict[str, Any]:
        try:
            return merge_statuses(results)
        except FormatError as exc:
            raise ReplicaError(str(exc), url=self.base_url, body=str(results)) from None

    def digests(self) -> dict[str, Any]:
        """`{"run_id", "version", "source", "digests": {hf_name: xxh3-128}}` of served weights.

        Tensor-parallel workers holding boxes each report their own: `digests` is then None
        and `workers` lists each worker's `{"digests", "boxes"}` (digests of the boxes).
        """
        results = self.rpc_all("deltasync_digests")
        if not all(isinstance(r, dict) for r in results):
            raise ReplicaError("workers sent no digests", url=self.base_url, body=str(results))
        first = results[0]
        if all(r.get("boxes") is None for r in results):
            if any(r != first for r in results[1:]):
                raise ReplicaError("workers disagree on their digests", url=self.base_url)
            return first
        self._one_version(results)
        workers = [{"digests": r["digests"], "boxes": r["boxes"]} for r in results]
        return first | {"digests": None, "boxes": None, "workers": workers}

    def engine_digests(self) -> tuple[int | None, list[dict[str, str]]]:
        """(version held, each worker's `{vLLM parameter name: xxh3-128}` of the engine's own
        parameters after its post-load processing): a replica serves a version exactly as a
        fresh load of it with the same flags when their workers' digests are equal."""
        results = self.rpc_all("deltasync_engine_digests")
        if not all(isinstance(r, dict) and isinstance(r.get("digests"), dict) for r in results):
            raise ReplicaError("workers sent no digests", url=self.base_url, body=str(results))
        if any(r["version"] != results[0]["version"] for r in results):
            raise ReplicaError("workers hold different versions", url=self.base_url)
        return results[0]["version"], [r["digests"] for r in results]

    def served_state_digest(
        self, *, timeout_s: float = 600.0, poll_s: float = 0.05
    ) -> tuple[int | None, StateDigest | None]:
        """(version, full-state digest) recomputed now over the served weights: the sum of
        every worker's share (one share per tensor-parallel worker). The workers compute their
        shares in the background while serving; this polls them (from `poll_s`, backing off
        to 0.5 s) for at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        results = self.rpc_all("deltasync_state_share", start="1")
        while True:
            if not all(isinstance(r, dict) and "share" in r for r in results):
                body = str(results)
                raise ReplicaError("workers sent no digest share", url=self.base_url, body=body)
            if not any(r.get("pending") for r in results):
                break
            if time.monotonic() > deadline:
                raise ReplicaError(
                    f"digest shares not ready after {timeout_s:g} s", url=self.base_url
                )
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.5)
            results = self.rpc_all("deltasync_state_share")
        self._one_version(results)
        if any(r["share"] is None for r in results):
            return results[0]["version"], None
        return results[0]["version"], total([StateDigest.parse(r["share"]) for r in results])

    def _one_version(self, results: list[dict[str, Any]]) -> None:
        first = (results[0]["run_id"], results[0]["version"])
        if any((r["run_id"], r["version"]) != first for r in results):
            raise ReplicaError(
                "workers hold different versions", url=self.base_url, body=str(results)
            )

    # -- weight sync ---------------------------------------------------------------------------

    def init(self, bucket: str, **options: bool | int) -> None:
        """Point the backend at a bucket (credentials stay in the server's environment). Once it
        follows one, only `prepack` and `recompute_every` may change: another bucket is 403."""
        self.request(
            "POST", "/init_weight_transfer_engine", {"init_info": {"bucket": bucket, **options}}
        )

    def stage(self, version: int, path: str | None = None) -> dict[str, Any]:
        """Start staging `version` in the background; the server keeps serving."""
        return self._merged(self.rpc_all("deltasync_stage", version=str(version), path=path or ""))

    def wait_staged(self, version: int, *, timeout_s: float = 600.0, poll_s: float = 0.05) -> str:
        """Poll until staging of `version` is ready or failed; returns the final state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.status()["staging"].get(str(version), "missing")
            if state != "running" or time.monotonic() > deadline:
                return state
            time.sleep(poll_s)

    def sync_to(
        self, version: int, path: str | None = None, *, stage_timeout_s: float = 600.0
    ) -> dict[str, Any]:
        """Bring the server to `version`: prefetch it (staging, polled in short requests while
        the server serves), then one `POST /deltasync/sync`, which pauses, applies, verifies,
        records the version, clears the prefix cache and resumes inside the server. On failure
        the server keeps its previous version and resumes; the error is a `ReplicaError`.

        Returns the server's answer (`version`, `pause_s`, `bytes`, `files`, `swapped`, ...)
        with `stage_s` the whole time spent staging and `staged` whether the prefetch was ready.
        """
        started = time.perf_counter()
        self.stage(version, path)
        staged = self.wait_staged(version, timeout_s=stage_timeout_s)
        prefetch_s = time.perf_counter() - started
        body: dict[str, Any] = {"version": version} | ({"path": path} if path else {})
        answer = self.request("POST", SYNC_PATH, body)
        if not isinstance(answer, dict) or answer.get("version") != version:
            raise ReplicaError(
                f"sync to version {version} answered no such version",
                url=self.base_url + SYNC_PATH,
                body=str(answer),
            )
        stage_s = prefetch_s + float(answer.get("stage_s") or 0.0)
        return answer | {"stage_s": stage_s, "staged": staged == "ready"}

    # -- generation ------------------------------------------------------------------------------

    def complete_tokens(
        self, model: str, prompt: list[int], max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """Greedy completion of token ids (EOS ignored); returns token ids and their logprobs."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        choice = self.request("POST", "/v1/completions", body)["choices"][0]
        return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """The logprob the served weights give each prompt token after the first (greedy)."""
        body = {
            "model": self.request("GET", "/v1/models")["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        ranked = self.request("POST", "/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [
            float(entry[str(t)]["logprob"]) for entry, t in zip(ranked[1:], prompt[1:], strict=True)
        ]
