"""The package's layers hold (issue 21): every import points down or sideways, and no
module imports itself back through others.

Layers, lowest first: 1 primitives (errors and the engine's path, signal and
diff code), 2 the tree and the catalogue, 3 the engine's runs and the
target's caches and fetch, 4 fork mode, 5 diagnosis and proof, 6 the CLI.
Lazy imports inside functions count too: they are dependencies all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "patchkit"
LAYERS = {
    1: ["patchkit.errors", "patchkit.symptoms", "patchkit.engine.safepath",
        "patchkit.engine.fsutil", "patchkit.engine.signals", "patchkit.engine.hunks",
        "patchkit.engine.diffs", "patchkit.engine.vocabulary"],
    2: ["patchkit.target.tree", "patchkit.catalogue"],
    3: ["patchkit.engine", "patchkit.target.caches", "patchkit.target.fetch"],
    4: ["patchkit.target.forkmode"],
    5: ["patchkit.diagnosis", "patchkit.proof", "patchkit.live"],
    6: ["patchkit.cli", "patchkit.entry", "patchkit.__main__"],
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The layer of a module: the longest prefix listed in LAYERS wins."""
    best, found = "", 0
    for number, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, found = prefix, number
    assert found, f"{module} is in no layer: add it to LAYERS"
    return found


def imports(path: Path) -> set[str]:
    """The patchkit modules a file imports (``from patchkit.x import y`` counts y if a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("patchkit"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("patchkit"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*candidate.split("."))).with_suffix(".py").is_file()
                found.add(candidate if is_module else node.module)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_import_points_down_or_sideways():
    wrong = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for name, path in MODULES.items()
        for target in imports(path)
        if layer(target) > layer(name)
    ]
    assert not wrong, wrong


def test_no_module_imports_itself_back():
    graph = {name: imports(path) & MODULES.keys() for name, path in
             MODULES.items()}  # fmt: skip
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError(" -> ".join(stack[stack.index(name) :] + [name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_package_init_files_import_nothing():
    """Empty __init__ files: importing patchkit.engine.hunks never drags the engine in."""
    for path in PACKAGE.rglob("__init__.py"):
        assert not imports(path), path
