"""The Hugging Face Hub side of `export`: a model's config and tokenizer in, a model repository out.

Everything goes through `huggingface_hub` (token from `HF_TOKEN` or `hf auth login`, endpoint
from `HF_ENDPOINT`); its errors become one-line `ExportError`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client: its transport errors are not OSErrors
from huggingface_hub import HfApi, get_token, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from deltasync.errors import ExportError

__all__ = ["Hub", "download_model_files", "validate_target"]

_HUB_ERRORS = (OSError, ValueError, RuntimeError, httpx2.HTTPError)  # RuntimeError: a failed LFS
# or Xet upload; ValueError: a malformed answer or argument
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def one_line(exc: BaseException) -> str:
    """The gist of a Hub error on one line: the HTTP status and the server's message."""
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        detail = exc.server_message or str(exc).splitlines()[0]
        return f"{exc.response.status_code} {' '.join(detail.split())}"
    return " ".join(str(exc).split()) or type(exc).__name__


def validate_target(repo_id: str) -> str:
    """`repo_id` when it is OWNER/NAME as the Hub accepts it; else an `ExportError`."""
    if repo_id.count("/") != 1:
        raise ExportError(f"--to {repo_id!r} is not a Hub repository id: expected OWNER/NAME")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ExportError(f"--to {repo_id!r} is not a Hub repository id: {one_line(exc)}") from None
    return repo_id


def download_model_files(repo_id: str, revision: str | None, patterns: Sequence[str]) -> Path:
    """The config and tokenizer files of a Hub model (no weights), downloaded or cached."""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))
    except _HUB_ERRORS as exc:
        at = f" at {revision}" if revision else ""
        raise ExportError(
            f"cannot get config and tokenizer of {repo_id}{at} from the Hub ({one_line(exc)}; "
            "no folder of that name here either): pass --model with a local folder"
        ) from None


@dataclass(frozen=True)
class Hub:
    """A logged-in client and the model repository an export goes to."""

    api: HfApi
    repo_id: str

    @classmethod
    def logged_in(cls, repo_id: str) -> Hub:
        """Check the token now, so a missing or refused login fails before the replay."""
        token = get_token()
        if token is None:
            raise ExportError(
                "not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN"
            )
        api = HfApi(token=token)
        try:
            api.whoami()
        except _HUB_ERRORS as exc:
            raise ExportError(f"the Hub did not accept the token: {one_line(exc)}") from None
        return cls(api, repo_id)

    def upload(self, folder: Path, *, private: bool, message: str) -> str:
        """Create the repository if needed and commit `folder` to it in one commit, removing
        weight files of an earlier export that this one does not have; returns its URL."""
        try:
            url = self.api.create_repo(self.repo_id, private=private or None, exist_ok=True)
            commit = self.api.upload_folder(
                repo_id=self.repo_id,
                folder_path=folder,
                commit_message=message,
                delete_patterns=list(WEIGHT_FILES),
            )
        except _HUB_ERRORS as exc:
            raise ExportError(f"upload to {self.repo_id} failed: {one_line(exc)}") from None
        return f"{url} (commit {commit.oid[:12]})"
