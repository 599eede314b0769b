"""The package's layers hold: every import inside deltasync/ - at module level, inside
functions, under TYPE_CHECKING, and the module paths handed to `import_tensor_side` or
`importlib` - runs from a higher layer to a lower one or within a layer, and no modules import
each other in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deltasync"

# (first module-path prefix that matches) -> layer; deltasync/__init__ is the facade, above all.
LAYERS = [
    ("deltasync.errors", 0),
    ("deltasync.arguments", 0),
    ("deltasync.defaults", 0),
    ("deltasync.settings", 0),
    ("deltasync.store", 1),
    ("deltasync.wire", 2),
    ("deltasync.kernels", 3),
    ("deltasync.codec", 4),
    ("deltasync.publisher", 5),
    ("deltasync.replica", 5),
    ("deltasync.vllm_ext", 6),
    ("deltasync.tools", 7),
    ("deltasync.__main__", 8),
    ("deltasync", 9),  # the facade
]
_MODULE_STRING = re.compile(r"""["'](deltasync(?:\.\w+)+)""")


def layer(module: str) -> int:
    for prefix, number in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return number
    raise AssertionError(f"{module} is in no layer")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known(modules: set[str], name: str) -> str | None:
    """`name`, or its longest prefix that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, modules: set[str], text: str | None = None) -> set[str]:
    """Every module of the package that `path` (or `text` as its source) imports, however it
    imports it."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    text = path.read_text() if text is None else text
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & modules
            found |= submodules  # `from deltasync.codec import ans` imports a module
            if len(submodules) < len(node.names) and (target := known(modules, source)):
                found.add(target)  # and names of the package itself
        elif isinstance(node, ast.Import):
            found |= {t for a in node.names if (t := known(modules, a.name)) is not None}
    for string in _MODULE_STRING.findall(text):  # module paths; not logger names
        if (target := known(modules, string)) not in (None, "deltasync"):
            found.add(target)
    found.discard(here)
    return {m for m in found if m.startswith("deltasync")}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imports(path, modules) for name, path in paths.items()}


def test_every_import_runs_down_the_layers():
    upward = [
        f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)})"
        for source, targets in sorted(graph().items())
        for target in sorted(targets)
        if layer(target) > layer(source) and not _is_parent_package(target, source)
    ]
    assert upward == []


# Inside layer 6: the wire between the processes, the worker side and the trainer's client, then
# server/ (which may use the client to catch up), its app and entry point, and the old paths.
VLLM_EXT_LAYERS = [
    ("deltasync.vllm_ext.protocol", 0),
    ("deltasync.vllm_ext.apply", 0),
    ("deltasync.vllm_ext.client", 1),
    ("deltasync.vllm_ext.engine", 1),
    ("deltasync.vllm_ext.worker", 2),
    ("deltasync.vllm_ext.server._site", 3),
    ("deltasync.vllm_ext.server.compat", 3),
    ("deltasync.vllm_ext.server.auth", 3),
    ("deltasync.vllm_ext.server.control", 3),
    ("deltasync.vllm_ext.server.follow", 4),
    ("deltasync.vllm_ext.server.app", 5),
    ("deltasync.vllm_ext.server.serve", 5),
    ("deltasync.vllm_ext.server", 6),
    ("deltasync.vllm_ext.auth", 7),
    ("deltasync.vllm_ext.serve", 7),
    ("deltasync.vllm_ext", 8),
]


def vllm_ext_layer(module: str) -> int:
    for prefix, number in VLLM_EXT_LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return number
    raise AssertionError(f"{module} is in no layer of vllm_ext")


def test_inside_vllm_ext_every_import_runs_down():
    """No arrow from a file of vllm_ext/ to one it builds on runs back up (the client imported
    the server's control plane for one constant, which the server's entry point then imported
    through the client)."""
    inside = "deltasync.vllm_ext"
    upward = [
        f"{source} imports {target}"
        for source, targets in sorted(graph().items())
        if source.startswith(inside + ".")
        for target in sorted(targets)
        if target.startswith(inside + ".") and not _is_parent_package(target, source)
        if vllm_ext_layer(target) > vllm_ext_layer(source)
    ]
    assert upward == []


def test_the_server_imports_nothing_of_the_worker_side():
    """vllm_ext/server/ runs in the serve parent (before vLLM loads) and the API server."""
    worker_side = (
        "deltasync.vllm_ext.engine",
        "deltasync.vllm_ext.worker",
        "deltasync.vllm_ext.apply",
    )
    found = [
        f"{source} imports {target}"
        for source, targets in sorted(graph().items())
        if source.startswith("deltasync.vllm_ext.server")
        for target in sorted(targets)
        if target.startswith(worker_side)
    ]
    assert found == []


def test_no_module_imports_the_facade():
    users = sorted(s for s, targets in graph().items() if "deltasync" in targets)
    assert users == ["deltasync.__main__"] or users == []


def test_no_circles():
    edges = {s: {t for t in ts if not _is_parent_package(t, s)} for s, ts in graph().items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == []


def _is_parent_package(target: str, source: str) -> bool:
    """Importing `deltasync.codec.files` runs `deltasync/codec/__init__.py` first; that is no
    import of the package's names (the facade's own imports are checked as its module)."""
    return source.startswith(target + ".")


@pytest.mark.parametrize(
    "source, text",
    [
        ("deltasync/wire/fields.py", "from deltasync.codec.files import decode"),
        ("deltasync/store/base.py", "import deltasync.tools.cli"),
        ("deltasync/kernels/jit.py", 'x = import_tensor_side("deltasync.publisher.snapshot")'),
        ("deltasync/wire/fields.py", "from deltasync.kernels import slices"),
        ("deltasync/errors.py", "from deltasync import Publisher"),
    ],
)
def test_the_check_sees_each_kind_of_import(source, text):
    """An upward import of each form, inside a function, is found (the tests above are not
    vacuous)."""
    path = PACKAGE.parent / source
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = imports(path, modules, f"def f():\n    {text}\n")
    assert found and all(layer(t) > layer(module_name(path)) for t in found)
