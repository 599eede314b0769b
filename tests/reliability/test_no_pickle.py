"""No pickle on the wire: the library never deserialises code, and pickle-shaped input is refused.

Weights travel as safetensors (a JSON header and raw bytes) and the manifest as JSON; nothing a
bucket holds may reach `pickle`, `torch.load`, `numpy.load(allow_pickle=True)` or a relative.
"""

from __future__ import annotations

import ast
import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from wire_samples import build_chain, fingerprint, join, publish_chain, replica_at, split

import deltasync
from deltasync.errors import FormatError
from deltasync.replica.replica import Replica
from deltasync.store import LocalStore

PACKAGE = Path(deltasync.__file__).parent
PICKLE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "dill",
    "cloudpickle",
    "joblib",
    "marshal",
    "shelve",
    "copyreg",
    "torch.serialization",
}
# Calls that unpickle, as dotted names after import aliases are resolved.
UNPICKLING_CALLS = {
    "torch.load",
    "torch.jit.load",
    "torch.package.PackageImporter",
    "numpy.load",
    "pandas.read_pickle",
    "joblib.load",
    "marshal.loads",
    "pickle.loads",
    "pickle.load",
    "pickle.Unpickler",
}


def _unpickling_uses(source: str, filename: str) -> list[str]:
    """Imports of pickle-family modules and calls of unpickling functions, with line numbers."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
                if alias.name in PICKLE_MODULES:
                    found.append(f"{filename}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module in PICKLE_MODULES or node.module.split(".")[0] in PICKLE_MODULES:
                found.append(f"{filename}:{node.lineno} from {node.module} import ...")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name in UNPICKLING_CALLS or (name or "").endswith("weights_only"):
            found.append(f"{filename}:{node.lineno} {name}(...)")
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg == "allow_pickle" and not (
                isinstance(value, ast.Constant) and value.value is False
            ):
                found.append(f"{filename}:{node.lineno} allow_pickle={ast.unparse(value)}")
            if keyword.arg == "weights_only" and not (
                isinstance(value, ast.Constant) and value.value is True
            ):
                found.append(f"{filename}:{node.lineno} weights_only={ast.unparse(value)}")
    return found


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = aliases.get(node.id, node.id)
    root = {"np": "numpy"}.get(root, root)
    return ".".join([root, *reversed(parts)])


def test_the_scanner_finds_what_it_looks_for() -> None:
    """The scan below can fail: each of these lines is reported."""
    source = "\n".join(
        [
            "import pickle",
            "import torch as T",
            "import numpy as np",
            "from torch import load as tl",
            "T.load(f)",
            "tl(f)",
            "np.load(f, allow_pickle=True)",
            "torch.load(f, weights_only=False)",
            "from joblib import load",
        ]
    )
    found = _unpickling_uses(source, "x.py")
    assert any("import pickle" in f for f in found)
    assert any("torch.load" in f and ":5 " in f for f in found)
    assert any(":6 torch.load" in f for f in found)
    assert any("allow_pickle=True" in f for f in found)
    assert any("weights_only=False" in f for f in found)
    assert any("joblib" in f for f in found)
    assert _unpickling_uses("import safetensors.torch\nsafetensors.torch.load(b)", "y.py") == []


def test_the_library_never_unpickles() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    found = [u for f in files for u in _unpickling_uses(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert found == []


class _Evil:
    """Unpickling this would create the marker file: the proof that something unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def _pickle_payloads(marker: Path) -> dict[str, bytes]:
    """Files a loader that unpickles would execute; none of them is a deltasync file."""
    raw = pickle.dumps(_Evil(marker))
    buffer = io.BytesIO()
    torch.save({"a.weight": _Evil(marker)}, buffer)  # what `torch.load` of a .bin would run
    chain = build_chain(2)
    header, data = split(chain.anchors[2])
    as_tensor = safetensors.torch.save(
        {"a.weight": torch.frombuffer(bytearray(raw), dtype=torch.uint8)},
        metadata=header["__metadata__"],
    )
    header["__metadata__"]["tensors"] = raw.decode("latin-1")
    in_metadata = join(header, data)
    even = raw + b"\0" * (len(raw) % 2)
    header, data = split(chain.anchors[2])
    header["a.weight"]["shape"] = [len(even) // 2]
    as_bf16 = safetensors.torch.save(
        {
            n: torch.frombuffer(bytearray(even), dtype=torch.bfloat16) if n == "a.weight" else t
            for n, t in safetensors.torch.load(chain.anchors[2]).items()
        },
        metadata=header["__metadata__"],
    )
    return {
        "raw-pickle": raw,
        "torch-save-zip": buffer.getvalue(),
        "pickle-as-u8-tensor": as_tensor,
        "pickle-in-metadata": in_metadata,
        "pickle-as-bf16-weights": as_bf16,
    }


@pytest.mark.parametrize(
    "name",
    [
        "raw-pickle",
        "torch-save-zip",
        "pickle-as-u8-tensor",
        "pickle-in-metadata",
        "pickle-as-bf16-weights",
    ],
)
def test_pickle_shaped_files_are_refused(name: str, marker: Path, monkeypatch) -> None:
    blob = _pickle_payloads(marker)[name]
    _booby_trap(monkeypatch)
    chain = build_chain(2)
    for replica in (replica_at(chain, None), replica_at(chain, 1)):
        before = fingerprint(replica)
        with pytest.raises(FormatError):
            replica.update(blob, path="runs/run/anchors/00000003-000000000000.safetensors")
        assert fingerprint(replica) == before
    assert not marker.exists()


def _forbidden(*args, **kwargs):
    raise AssertionError("the library tried to unpickle")


def _booby_trap(monkeypatch) -> None:
    """Every unpickling entry point fails the test if anything calls it."""
    for module, name in [
        (pickle, "loads"),
        (pickle, "load"),
        (pickle, "Unpickler"),
        (torch, "load"),
        (np, "load"),
    ]:
        monkeypatch.setattr(module, name, _forbidden)


def test_a_full_sync_never_calls_an_unpickler(tmp_path: Path, monkeypatch) -> None:
    """Publishing and syncing a real bucket with every unpickler booby-trapped."""
    _booby_trap(monkeypatch)
    chain = build_chain(4)
    store = LocalStore(tmp_path)
    publish_chain(store, chain)
    replica = Replica()
    assert replica.sync(store) == [4]
