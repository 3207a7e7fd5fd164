"""The error kinds patchkit/ defines, read from its source with ``ast``: each PatchkitError
subclass and the code it names (tests/test_errors_are_typed.py keeps every kind coded,
tests/test_json_contract.py lets a kind's code say its line as its words)."""

from __future__ import annotations

import ast
from functools import cache

from patchkit.codes import Code
from tests.conftest import REPO

PACKAGE = REPO / "patchkit"
BASE = "PatchkitError"


def _name(node: ast.expr) -> str:
    """``X`` of ``X`` or of ``module.X``."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def classes_of(source: str) -> dict[str, tuple[list[str], str | None]]:
    """Each class of ``source``: its bases' names, and the code it names (a ``code =
    Code.X`` in its body, "property" for a ``code`` property), or None."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        code = None
        for stmt in node.body:
            if isinstance(stmt, ast.Assign) and any(_name(t) == "code" for t in stmt.targets):
                code = _name(stmt.value)
            elif isinstance(stmt, ast.FunctionDef) and stmt.name == "code":
                code = "property"
        found[node.name] = ([_name(b) for b in node.bases], code)
    return found


@cache
def error_kinds() -> dict[str, str | None]:
    """Every PatchkitError subclass patchkit/ defines, by name: the code it names or
    inherits (None: none)."""
    classes: dict[str, tuple[list[str], str | None]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        classes.update(classes_of(path.read_text()))

    def code_of(name: str, seen: frozenset = frozenset()) -> str | None | bool:
        """The class's code; False when it is no PatchkitError."""
        if name == BASE:
            return None
        if name not in classes or name in seen:
            return False
        bases, code = classes[name]
        inherited = [code_of(b, seen | {name}) for b in bases]
        if all(i is False for i in inherited):
            return False
        return code or next((i for i in inherited if i), None)

    kinds = {name: code_of(name) for name in classes if name != BASE}
    return {name: code for name, code in kinds.items() if code is not False}


def error_codes() -> set[Code]:
    """The codes the error kinds name: their words are the line each error was raised with."""
    return {Code[name] for name in error_kinds().values() if name and name != "property"}


def bare_raises(source: str) -> list[int]:
    """The lines of ``source`` that make a PatchkitError itself (``raise PatchkitError(...)``,
    or one made to be raised later)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and _name(node.func) == BASE
    ]
