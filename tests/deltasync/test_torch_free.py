"""The bucket side runs without torch: `inspect`, reading a manifest, the serve launcher's parent
logic and the dashboard, each in a process where torch, numba and `safetensors.torch` cannot be
imported. (Every real replica the trainer tests start runs its launcher that way too.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from no_torch_site import UNIMPORTABLE, without_modules

FIXTURES = Path(__file__).parents[1] / "fixtures" / "protocol-1"
BUCKET = FIXTURES / "bucket-packed"
DELTA = next((BUCKET / "runs" / "fixture-packed" / "deltas").glob("00000003-*.safetensors"))
ROOT = Path(__file__).parents[2]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-c", textwrap.dedent(code)] if code else args)]
    env = without_modules(dict(os.environ), *UNIMPORTABLE)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_tensor_side_is_really_unimportable():
    done = _run(
        code="""
        import deltasync
        try:
            deltasync.Replica
        except ImportError as exc:
            print("refused:", exc)
        """
    )
    assert (
        "refused: deltasync.replica.replica needs torch: pip install 'deltasync[torch]'"
        in done.stdout
    )


# The torch-free rooms, by folder: every module in them imports where torch cannot.
TORCH_FREE = ("deltasync/store", "deltasync/wire")
TORCH_FREE_MODULES = (
    "deltasync",
    "deltasync.codec",
    "deltasync.replica.replay",
    "deltasync.replica.driven",  # planning a sync: manifest, read ahead
    "deltasync.tools.cli",  # `inspect`
    "deltasync.vllm_ext.server.serve",  # the serve parent
    "deltasync.vllm_ext.serve",
    "spaces.dashboard.app",
)


def test_torch_free_folders_import_without_torch():
    folders = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for folder in TORCH_FREE
        for p in sorted((ROOT / folder).glob("*.py"))
    ]
    modules = [*folders, *TORCH_FREE_MODULES]
    assert "deltasync.wire.manifest" in modules and "deltasync.store.base" in modules
    done = _run(code=f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n")
    assert done.returncode == 0


def test_inspect_reads_a_real_file():
    done = _run("-m", "deltasync", "inspect", str(DELTA), "--json")
    summary = json.loads(done.stdout)
    assert summary["kind"] == "delta" and summary["version"] == 3
    assert summary["total_elements"] == 17 * 8 + 8 + 5 * 3
    assert 0 < summary["changed_elements"] < summary["total_elements"]


def test_manifest_plan_and_file_checks():
    done = _run(
        code=f"""
        from deltasync import open_store, read_manifest
        from deltasync.codec import ParsedFile
        from deltasync.wire.manifest import fetch_entry, fetch_file

        store = open_store({str(BUCKET)!r})
        manifest = read_manifest(store)
        plan = manifest.plan(None, None)
        print([(e.kind, e.version) for e in plan])
        print([ParsedFile.parse(fetch_file(store, e.files[0])).meta.version for e in plan])
        stored = fetch_entry(store, plan[0])  # an anchor: its header read, its bytes in pieces
        print(stored.meta.version, sum(len(data) for _, data in stored.stream()))
        """
    )
    lines = done.stdout.split("\n")[:3]
    assert lines[:2] == ["[('anchor', 4)]", "[4]"]
    assert lines[2] == f"4 {read_manifest_entry_bytes()}"


def read_manifest_entry_bytes() -> int:
    manifest = json.loads((BUCKET / "manifest.json").read_text())
    return max(manifest["anchors"], key=lambda a: a["version"])["bytes"]


def test_serve_launcher_parent_logic():
    """Argument checks, the bucket read, vLLM's command line and the bootstrap sequence."""
    done = _run(
        code=f"""
        from deltasync.vllm_ext.server import serve

        class Server:
            calls = []
            def init(self, bucket, **options): self.calls.append(("init", bucket))
            def sync_to(self, version, path=None, *, pause="keep"):
                self.calls.append(("sync_to", version))
                return {{"stage_s": 0.0, "pause_s": 0.0}}

        cmd = serve.server_command("m", host="127.0.0.1", port=8001, auth=True,
                                   bootstrap_from_bucket=True, cpu=True)
        assert "--worker-extension-cls" in cmd, cmd
        server = Server()
        print(serve.bootstrap(server, {str(BUCKET)!r}), server.calls)
        print(serve.main(["--model", "m", "--bucket", {str(BUCKET)!r}]))
        """
    )
    lines = done.stdout.split("\n")
    assert lines[0] == f"4 [('init', '{BUCKET}'), ('sync_to', 4)]"
    assert lines[1] == "2"  # no token and no --insecure-no-auth: refused before vLLM starts
    assert "DELTASYNC_API_KEY" in done.stderr


@pytest.mark.parametrize("bucket", ["bucket-packed", "bucket-coo"])
def test_dashboard_builds_and_reads_the_bucket(bucket):
    done = _run(
        code=f"""
        from spaces.dashboard.app import build_dashboard
        from spaces.dashboard.data import BucketWatcher

        demo = build_dashboard({str(FIXTURES / bucket)!r})
        print(type(demo).__name__)
        """
    )
    assert done.stdout.strip() == "Blocks"
