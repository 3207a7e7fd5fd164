"""scripts/ takes from patchkit.verify only what patchkit.verify.toolkit exposes for it.

The benchmarks and GPU proofs back the ledger's numbers; verify's insides change
(its modules split, its rule replaced) without asking them. So every import of
patchkit.verify in scripts/ goes through the one module kept for them, and each
name they take from it is one it exposes.
"""

from __future__ import annotations

import ast
from pathlib import Path

from patchkit.verify import toolkit

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SURFACE = "patchkit.verify.toolkit"


def verify_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of patchkit.verify in one script."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("patchkit.verify"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("patchkit.verify"):
                    found.append((node.lineno, alias.name, []))
    return found


def used(path: Path) -> set[str]:
    """The names a script reads as ``toolkit.NAME``."""
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "toolkit"
    }


def test_scripts_import_verify_only_through_its_surface():
    wrong = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        for line, module, names in verify_imports(path):
            through = module == SURFACE or (module == "patchkit.verify" and names == ["toolkit"])
            if not through:
                wrong.append(f"{path.relative_to(SCRIPTS)}:{line}: {module} {names}")
            elif module == SURFACE:
                wrong += [f"{path.name}:{line}: {n}" for n in names if n not in toolkit.__all__]
        wrong += [f"{path.name}: toolkit.{n}" for n in used(path) if n not in toolkit.__all__]
    assert wrong == [], "\n".join(wrong)


def test_the_surface_names_what_it_exposes():
    assert sorted(toolkit.__all__) == sorted(set(toolkit.__all__))
    assert all(hasattr(toolkit, name) for name in toolkit.__all__)
