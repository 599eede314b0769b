"""`python -m deltasync export`: a version of a bucket written by the real publisher becomes a
model folder that transformers loads bit for bit, or a Hub upload made by the real `HfApi`
against a local fake of the Hub's HTTP API; bad input ends in one line and writes nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import safetensors.torch
import torch
from huggingface_hub import constants as hub_constants
from model_steps import AdamWLoop
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.publisher.snapshot import Bf16Snapshot
from deltasync.store import LocalStore
from deltasync.tools.cli import main
from deltasync.tools.export.model_files import ModelFiles
from deltasync.tools.export.weights import model_card, write_model
from deltasync.wire.digests import StateDigest, tensor_digest
from deltasync.wire.policy import AnchorPolicy
from deltasync.wire.source import ModelSource
from trainer.random_qwen3 import build_tiny_qwen3

ROOT = Path(__file__).parents[3]
TOKEN = "hf_fake_export_token"


def _publish(folder: Path, model_dir: Path, versions: int, *, virtual: bool) -> dict:
    """A run of `versions` AdamW steps on the tiny Qwen3 built in `model_dir`; version 1 is a
    virtual anchor naming that folder when `virtual`. Returns each version's bf16 state."""
    model = build_tiny_qwen3(model_dir)
    loop, states = AdamWLoop(model, lr=1e-3), {}
    config = PublisherConfig(
        run_id="export-run",
        policy=AnchorPolicy(interval=3, max_delta_fraction=None, keep_anchors=2),
        source=ModelSource("folder", str(model_dir.resolve())) if virtual else None,
    )
    with Publisher(LocalStore(folder), config) as publisher:
        for version in range(1, versions + 1):
            if version > 1:
                loop.step()
            publisher.publish(model).result(timeout=60)
            states[version] = {n: t.clone() for n, t in Bf16Snapshot.capture(model).tensors.items()}
    return states


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """3 versions: the bucket still holds the virtual anchor naming the model folder."""
    root = tmp_path_factory.mktemp("recorded")
    return (
        root / "bucket",
        root / "model",
        _publish(root / "bucket", root / "model", 3, virtual=True),
    )


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """8 versions, anchors every 3, two kept: versions 4..8 remain, no model source."""
    root = tmp_path_factory.mktemp("pruned")
    return (
        root / "bucket",
        root / "model",
        _publish(root / "bucket", root / "model", 8, virtual=False),
    )


def _assert_bitwise(tensors: dict, state: dict) -> None:
    assert set(state) <= set(tensors)
    for name, expected in state.items():
        found = tensors[name]
        assert found.dtype == torch.bfloat16, name
        assert torch.equal(found.view(torch.int16), expected.view(torch.int16)), name


def _loaded(folder: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)  # the tokenizer came along
    return dict(model.named_parameters())


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_out_loads_in_transformers_bitwise(recorded, tmp_path, capsys):
    """No --model: config and tokenizer come from the folder the virtual anchor names."""
    bucket, _, states = recorded
    out = tmp_path / "exported" / "v3"
    assert main(["export", str(bucket), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "replayed run export-run to version 3" in printed and "verified" in printed
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
    }
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_bitwise(safetensors.torch.load_file(out / "model.safetensors"), states[3])
    _assert_bitwise(_loaded(out), states[3])
    assert "version 3" in (out / "README.md").read_text()
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's 0o700


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_an_older_version_with_model(pruned, tmp_path):
    bucket, model_dir, states = pruned
    out = tmp_path / "v6"
    args = ["export", str(bucket), "--version", "6", "--model", str(model_dir), "--out", str(out)]
    assert main([*args, "--quiet", "--run-id", "export-run"]) == 0
    _assert_bitwise(_loaded(out), states[6])


VLLM_LOAD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from safetensors.torch import load_file
from vllm_in_process import build_vllm_model, release_vllm_runtime
from deltasync.wire.digests import tensor_digest
from deltasync.vllm_ext.apply.layout import LayoutOf
model = build_vllm_model(sys.argv[2])
shapes = {n: tuple(t.shape) for n, t in load_file(sys.argv[2] + "/model.safetensors").items()}
served = dict(model.named_parameters(remove_duplicate=False))
placed = LayoutOf(model, model.vllm_config)(shapes).exact()
def run(p):
    flat = served[p.param_name].data.view(-1)
    return flat[p.offset : p.offset + p.box.numel].view(p.box.local_shape)
print(json.dumps({n: tensor_digest(run(p).contiguous()) for n, p in placed.items()}))
release_vllm_runtime()
"""


def test_export_loads_in_vllm_bitwise(recorded, tmp_path):
    """vLLM's own config parsing, Qwen3 class and `load_weights` (no engine; in a process of
    its own, as vLLM changes the environment): every served slot holds the version's bits."""
    bucket, _, states = recorded
    out = tmp_path / "v3"
    assert main(["export", str(bucket), "--out", str(out), "--quiet"]) == 0
    result = subprocess.run(
        [sys.executable, "-c", VLLM_LOAD, str(ROOT / "tests" / "deltasync" / "vllm_ext"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served == {name: tensor_digest(t) for name, t in states[3].items()}


def test_sharded_export_loads(pruned, tmp_path):
    """A model over the shard size is written as shards plus an index, as save_pretrained does."""
    _, model_dir, states = pruned
    files = ModelFiles(model_dir, str(model_dir))
    written = write_model(
        states[8], files, tmp_path, model_card("r", 8, None, files), max_shard_size=60_000
    )
    shards = [n for n in written if n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in written
    _assert_bitwise(_loaded(tmp_path), states[8])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--version", "9"],
            "version 9 of run export-run is not committed yet; the bucket holds versions 4..8",
        ),
        (
            ["--version", "2"],
            "version 2 of run export-run was deleted by retention; the bucket holds versions 4..8",
        ),
        (
            ["--run-id", "other-run"],
            "run 'other-run' is not committed in this bucket: it holds run 'export-run'",
        ),
        ([], "does not record the model run export-run started from"),
        (
            ["--model", "/no/such/model/dir"],
            "--model /no/such/model/dir: no such folder",
        ),
    ],
)
def test_bad_requests_end_in_one_line_and_write_nothing(pruned, tmp_path, capsys, args, message):
    bucket, _, _ = pruned
    before = _tree(bucket)
    out = tmp_path / "out"
    assert main(["export", str(bucket), "--out", str(out), "--quiet", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deltasync: error: ") and message in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert _tree(bucket) == before


def test_a_replay_that_misses_the_manifests_digest_writes_nothing(
    recorded, tmp_path, capsys, monkeypatch
):
    """The replayed state is hashed again and compared with the manifest before any write."""
    import deltasync.tools.export.weights

    monkeypatch.setattr(
        deltasync.tools.export.weights, "full_state_digest", lambda tensors: StateDigest.zero()
    )
    out = tmp_path / "out"
    assert main(["export", str(recorded[0]), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "version 3 replayed to full-state digest 00000000" in err and "the manifest says" in err
    assert list(tmp_path.iterdir()) == []


def test_another_runs_leftovers_are_named(pruned, tmp_path, capsys):
    """A bucket commits one run; files another run left under runs/ are listed, not exported."""
    bucket = tmp_path / "bucket"
    shutil.copytree(pruned[0], bucket)
    LocalStore(bucket).put("runs/old-run/anchors/00000001-0123456789ab.safetensors", b"x")
    args = ["export", str(bucket), "--run-id", "old-run", "--out", str(tmp_path / "out")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "run 'old-run' is not committed in this bucket: it holds run 'export-run'" in err
    assert "uncommitted files of ['old-run']" in err and not (tmp_path / "out").exists()


def test_missing_or_empty_bucket(tmp_path, capsys):
    missing = tmp_path / "no-bucket"
    assert main(["export", str(missing), "--out", str(tmp_path / "out")]) == 1
    assert "no bucket folder at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not created on the way
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 1
    assert "has no manifest (nothing published yet)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_a_model_of_another_shape_is_refused(pruned, tmp_path, capsys):
    bucket, _, _ = pruned
    other = tmp_path / "other"
    build_tiny_qwen3(other, tie=False)  # an untied head: lm_head.weight the bucket lacks
    args = ["export", str(bucket), "--model", str(other), "--out", str(tmp_path / "out")]
    assert main([*args, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "the weights do not fit the config of" in err and "lm_head.weight" in err
    assert not (tmp_path / "out").exists()


def test_a_full_out_folder_is_left_alone(pruned, tmp_path, capsys):
    bucket, model_dir, _ = pruned
    (tmp_path / "keep.txt").write_text("mine")
    args = ["export", str(bucket), "--model", str(model_dir), "--out", str(tmp_path)]
    assert main(args) == 1
    assert "is not empty" in capsys.readouterr().err
    assert _tree(tmp_path) == {"keep.txt": b"mine"}


@pytest.mark.parametrize("target", ["alice", "alice/bad name", "a/b/c", "alice/--x"])
def test_a_malformed_repo_id_is_an_argument_error(pruned, target, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(pruned[0]), "--to", target])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --to: " in err and "Traceback" not in err


# --- upload: the real HfApi against a fake of the Hub's HTTP API --------------------------------


class FakeHub(ThreadingHTTPServer):
    """Answers the requests huggingface_hub 2.4's `whoami`, `create_repo` and `upload_folder`
    (LFS path) make, as the Hub does, and keeps the repositories' files; every request is
    logged as (method, path, Authorization)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lfs: dict[str, bytes] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.created: list[dict] = []
        self.unknown: list[str] = []


class _HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, status: int, body: object, code: str | None = None) -> None:
        """JSON, and as the Hub an error's message (and code) in headers too."""
        data = json.dumps(body).encode()
        self.send_response(status)
        if isinstance(body, dict) and "error" in body:
            self.send_header("X-Error-Message", body["error"])
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _handle(self) -> None:
        path = urlsplit(self.path).path
        auth = self.headers.get("Authorization")
        self.server.log.append((self.command, path, auth))
        if (self.command, path) == ("GET", "/api/agent-harnesses"):  # public; the client's own
            return self._reply(200, {"standardEnvVars": [], "harnesses": {}})
        if auth != f"Bearer {TOKEN}" and not path.startswith("/lfs-upload/"):
            return self._reply(401, {"error": "Invalid credentials in Authorization header"})
        parts = path.strip("/").split("/")
        route = (self.command, *parts[:2])
        if route == ("GET", "api", "whoami-v2"):
            return self._reply(200, {"type": "user", "name": "alice", "orgs": []})
        if route == ("POST", "api", "repos"):  # /api/repos/create
            return self._create(json.loads(self._body()))
        if route == ("POST", "api", "validate-yaml"):
            return self._reply(200, {"errors": [], "warnings": []})
        if self.command == "PUT" and parts[0] == "lfs-upload":
            data = self._body()
            if hashlib.sha256(data).hexdigest() != parts[1]:
                return self._reply(400, {"error": "sha256 mismatch"})
            self.server.lfs[parts[1]] = data
            return self._reply(200, {})
        if self.command == "GET" and len(parts) == 4 and parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:])  # repo_info: how create_repo(exist_ok) checks a 403
            if repo not in self.server.repos:
                return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
            return self._reply(200, {"id": repo, "sha": "0" * 40, "private": False})
        if len(parts) >= 5 and parts[:2] == ["api", "models"]:
            repo, action = "/".join(parts[2:4]), parts[4]
            if repo not in self.server.repos:
                return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
            return self._repo_call(repo, action)
        if self.command == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch(json.loads(self._body()))
        self.server.unknown.append(f"{self.command} {path}")
        return self._reply(404, {"error": "not found"})

    do_GET = do_POST = do_PUT = _handle

    def _create(self, payload: dict) -> None:
        self.server.created.append(payload)
        if (
            payload.get("organization") not in (None, "alice")
            or payload.get("type", "model") != "model"
        ):
            namespace = payload.get("organization")
            denied = (
                f'You don\'t have the rights to create a model under the namespace "{namespace}"'
            )
            return self._reply(403, {"error": denied})
        repo = f"{payload['organization']}/{payload['name']}"
        if repo in self.server.repos:
            url = f"{self.server.url}/{repo}"  # the Hub names it; the client reads it
            return self._reply(409, {"error": "You already created this model repo", "url": url})
        self.server.repos[repo] = {".gitattributes": b"*.safetensors filter=lfs\n"}
        return self._reply(200, {"url": f"{self.server.url}/{repo}"})

    def _repo_call(self, repo: str, action: str) -> None:
        files = self.server.repos[repo]
        if self.command == "GET" and action == "tree":
            listing = [
                {"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for p, d in sorted(files.items())
            ]
            return self._reply(200, listing)
        if self.command == "POST" and action == "preupload":
            wanted = json.loads(self._body())["files"]
            modes = [
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                    "shouldIgnore": False,
                    "oid": None,
                }
                for f in wanted
            ]
            return self._reply(200, {"files": modes})
        if self.command == "POST" and action == "commit":
            return self._commit(repo, self._body())
        self.server.unknown.append(f"{self.command} {self.path}")
        return self._reply(404, {"error": "not found"})

    def _lfs_batch(self, payload: dict) -> None:
        assert payload["operation"] == "upload" and "basic" in payload["transfers"]
        objects = [
            {
                "oid": o["oid"],
                "size": o["size"],
                "actions": {"upload": {"href": f"{self.server.url}/lfs-upload/{o['oid']}"}},
            }
            for o in payload["objects"]
        ]
        return self._reply(200, {"transfer": "basic", "objects": objects})

    def _commit(self, repo: str, body: bytes) -> None:
        files = self.server.repos[repo]
        staged = dict(files)
        for line in body.decode().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "file":
                staged[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.server.lfs:
                    return self._reply(400, {"error": f"LFS object {value['oid']} missing"})
                staged[value["path"]] = self.server.lfs[value["oid"]]
            elif key == "deletedFile":
                staged.pop(value["path"])
            elif key != "header":
                return self._reply(400, {"error": f"unknown commit key {key}"})
        files.clear()
        files.update(staged)
        oid = hashlib.sha1(body).hexdigest()
        url = f"{self.server.url}/{repo}/commit/{oid}"
        return self._reply(200, {"commitUrl": url, "commitOid": oid})


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _hub_env(hub: FakeHub, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1")
    # Xet uploads talk to a content-addressed store in Rust that no local fake can stand in for;
    # with it off the library takes the LFS path, whose requests this fake answers.
    if token:
        env["HF_TOKEN"] = token
    return env


def test_upload_with_the_real_client(recorded, hub, tmp_path):
    """One commit replaces an earlier export's shards: the repository then loads bitwise."""
    bucket, _, states = recorded
    hub.repos["alice/tiny-grpo"] = {
        ".gitattributes": b"*.safetensors filter=lfs\n",
        "model-00001-of-00002.safetensors": b"stale",
        "model.safetensors.index.json": b"{}",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltasync",
            "export",
            str(bucket),
            "--to",
            "alice/tiny-grpo",
            "--private",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=_hub_env(hub, tmp_path / "hf-home"),
    )
    assert result.returncode == 0, result.stderr
    assert f"uploaded to {hub.url}/alice/tiny-grpo (commit " in result.stdout
    assert hub.unknown == []
    calls = [(m, p, auth) for m, p, auth in hub.log if p != "/api/agent-harnesses"]
    assert all(auth == f"Bearer {TOKEN}" for _, p, auth in calls if not p.startswith("/lfs-"))
    calls = [(m, p) for m, p, _ in calls]
    assert calls[0] == ("GET", "/api/whoami-v2")  # the login is checked before the replay
    assert calls[-1] == ("POST", "/api/models/alice/tiny-grpo/commit/main")
    assert hub.created == [{"name": "tiny-grpo", "organization": "alice", "visibility": "private"}]
    files = hub.repos["alice/tiny-grpo"]
    assert (
        "model-00001-of-00002.safetensors" not in files
        and "model.safetensors.index.json" not in files
    )
    repo = tmp_path / "clone"
    repo.mkdir()
    for name, data in files.items():
        (repo / name).write_bytes(data)
    _assert_bitwise(_loaded(repo), states[3])


def test_upload_errors_are_one_line(recorded, hub, tmp_path, monkeypatch, capsys):
    """Not logged in (nothing sent), a refused token, a namespace the user cannot write to: one
    line each, and no repository is created."""
    bucket, _, _ = recorded
    monkeypatch.setattr(hub_constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    export = ["export", str(bucket), "--quiet", "--to"]
    assert main([*export, "alice/x"]) == 1
    assert "not logged in to the Hugging Face Hub" in capsys.readouterr().err and hub.log == []
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main([*export, "alice/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the Hub did not accept the token: 401" in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = ["export", str(bucket), "--quiet", "--out", str(tmp_path / "out"), "--model"]
    assert main([*model, "alice/no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "cannot get config and tokenizer of alice/no-such-model from the Hub (404" in err
    assert main([*export, "bob/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "upload to bob/x failed: 403" in err and "namespace" in err
    assert hub.repos == {} and hub.unknown == []
