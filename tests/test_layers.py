"""The package's layers hold: the table in CONTRIBUTING.md, checked from the package names.

A module imports from its own package or a lower layer, never from a higher
layer or from another package of its own layer, and never back into itself
through others. Lazy imports inside functions count too: they are
dependencies all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "patchkit"
ROW = re.compile(r"^\| (\d+) \| (.+) \|$")


def layer_table() -> dict[str, int]:
    """{package: layer} from CONTRIBUTING.md's table (``| 0 | `patchkit` (...) |``)."""
    table = {}
    for line in (REPO / "CONTRIBUTING.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            for name in re.findall(r"`(patchkit[\w.]*)`", match[2]):
                table[name] = int(match[1])
    return table


LAYERS = layer_table()


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def package_of(module: str) -> str:
    """The table's name for a module: its package; `patchkit` for the root's own modules."""
    if module == "patchkit.__main__":  # `python -m patchkit`: the CLI's, as the table says
        return "patchkit.cli"
    parts = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    return "patchkit" if len(parts) == 2 and not is_package else ".".join(parts[:2])


def imports(path: Path) -> set[str]:
    """The patchkit modules a file imports (``from patchkit.x import y`` counts y if a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("patchkit"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("patchkit"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return found & MODULES.keys()


def test_every_package_is_in_the_table():
    missing = sorted({package_of(name) for name in MODULES} - LAYERS.keys())
    assert not missing, f"add these to CONTRIBUTING.md's layer table: {missing}"


def test_every_import_points_down_or_within_its_package():
    wrong = []
    for name, path in MODULES.items():
        here = package_of(name)
        for target in imports(path):
            there = package_of(target)
            if there == here:
                continue
            if LAYERS[there] > LAYERS[here]:
                wrong.append(f"{name} (layer {LAYERS[here]}) imports {target} (layer up)")
            elif LAYERS[there] == LAYERS[here]:
                wrong.append(f"{name} imports {target}, a sibling package of its layer")
    assert not wrong, wrong


def test_no_module_imports_itself_back():
    graph = {name: imports(path) for name, path in MODULES.items()}
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


def test_no_import_is_renamed_to_read_well():
    """`from patchkit.x import y as z` hides what a name is; name modules well instead."""
    renamed = [
        f"{module_name(path)}: {node.module}.{alias.name} as {alias.asname}"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("patchkit")
        for alias in node.names
        if alias.asname
    ]
    assert not renamed, renamed


def test_the_package_init_files_import_nothing():
    """Empty __init__ files: importing patchkit.diffs.hunks never drags the engine in."""
    for path in PACKAGE.rglob("__init__.py"):
        assert not imports(path), path


def test_no_folder_is_named_like_build_output():
    """Build tools, .gitignore templates and code browsers skip these names."""
    named = {"target", "build", "dist", "out", "bin", "obj"}
    found = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name in named]
    assert not found, found


def test_every_package_is_installed():
    """pyproject.toml lists the packages a wheel carries: a package left out imports here
    (the checkout is on the path) and fails in every installed copy (the Docker step)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
