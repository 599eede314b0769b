"""Hub buckets go through HfFileSystem with paths rooted at `buckets/NS/NAME` (no network)."""

from __future__ import annotations

from huggingface_hub import HfFileSystem

from deltasync.store import open_store


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "find":
                return [f"{args[0]}/deltas/00000002-aaaaaaaaaaaa.safetensors", "buckets/ns/other/x"]
            if name == "size":
                return 100
            return b"data"

        return record


def test_hub_bucket_paths(monkeypatch):
    store = open_store("hf://buckets/ns/name/rl")
    assert isinstance(store.fs, HfFileSystem) and store.root == "buckets/ns/name/rl"
    recorder = Recorder()
    monkeypatch.setattr(store, "fs", recorder)
    store.put("manifest.json", b"{}")
    store.get("runs/r/deltas/x.safetensors")
    store.get_range("runs/r/deltas/x.safetensors", 0, 8)
    listed = store.list("runs/r")
    names = [(name, args) for name, args, _ in recorder.calls]
    assert ("pipe_file", ("buckets/ns/name/rl/manifest.json", b"{}")) in names
    assert ("cat_file", ("buckets/ns/name/rl/runs/r/deltas/x.safetensors",)) in names
    assert ("find", ("buckets/ns/name/rl/runs/r",)) in names
    ranged = [c for c in recorder.calls if c[0] == "cat_file" and c[2]]
    assert ranged[0][2] == {"start": 0, "end": 8}
    assert listed == ["runs/r/deltas/00000002-aaaaaaaaaaaa.safetensors"]  # other buckets ignored
