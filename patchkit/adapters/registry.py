"""Which class a vLLM release serves for an architecture on CUDA, read from its own registry.

vLLM's ``ModelRegistry`` is built from ``_VLLM_MODELS`` in
``vllm/model_executor/models/registry.py``: a dict merged (``**``) from
per-task dicts of ``"Arch": ("module", "Class")``. A module name that starts
with ``vllm.`` is taken as it is (``_resolve_module_name``, 0.26.0 on; 0.34.0
moves ``Qwen3_5*`` to ``vllm.models.qwen3_5``), any other is under
``vllm.model_executor.models``. The registry imports the module and takes the
class from it; a package's ``__init__.py`` may re-export it from a submodule
chosen by platform (0.34.0's ``vllm/models/qwen3_5/__init__.py``: ``if
TYPE_CHECKING or current_platform.is_cuda(): from .nvidia.model import ...``,
else the old ``vllm.model_executor.models.qwen3_5``). This module follows the
same steps on the tree's files, parsed (ast) and never imported, with CUDA
as the platform, to the file whose ``class`` statement defines the class.

The tree is untrusted: every file is read through ``tree.fs`` (bounded, no
links out); a module name that is not dotted identifiers under ``vllm``, a
missing file, a class no file defines or a branch whose platform test this
module cannot decide is one :class:`NotUnderstood` line naming the file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.vllmtree.tree import VllmTree

REGISTRY = "vllm/model_executor/models/registry.py"
_MODELS_PACKAGE = "vllm.model_executor.models"
_ALL = "_VLLM_MODELS"
_MAX_HOPS = 4  # re-exports followed from the registry's module to the class statement
# The largest Python file read (vLLM 0.34.0's largest is under 300 kB) and the deepest
# syntax tree walked (its deepest is 30 nodes; the walks recurse once or twice a level).
MAX_SOURCE_BYTES = 4 << 20
MAX_DEPTH = 100
# Dicts merged into _VLLM_MODELS (`**_TEXT_GENERATION_MODELS`, ...: 0.34.0 has 8), and
# classes followed through their bases; a longer chain is a file patchkit does not read.
MAX_CHAIN = 64
# platform tests in a model package's __init__.py, as on a CUDA machine
_CUDA_TRUE = {"is_cuda", "is_cuda_alike"}


class NotUnderstood(PatchkitError):
    """The release's code is not in a form patchkit reads (a file missing, too large or
    nested too deep, a registry entry or a mapping it cannot follow): ``path`` names the
    file; the line says where in it."""

    code = Code.VLLM_CODE_NOT_UNDERSTOOD


@dataclass(frozen=True)
class Served:
    """The registry's class for one architecture, and the file that defines it."""

    arch: str
    module: str  # the registry's module, resolved: vllm.models.qwen3_5
    cls: str  # the class's name in the file that defines it
    file: str  # relpath of that file: vllm/models/qwen3_5/nvidia/model.py
    via: tuple[str, ...]  # the files read from the module's to the class's (that one last)


def parse(tree: VllmTree, relpath: str, why: str) -> ast.Module | None:
    """A tree file's syntax tree; None when it is missing.

    The file is the tree's, so it may be anything: larger than MAX_SOURCE_BYTES,
    nested past what Python's parser takes (it raises RecursionError or
    MemoryError then, not SyntaxError), or parsed but nested deeper than
    MAX_DEPTH, which every walk here would recurse through: each is one line
    naming the file."""
    found = tree.fs.lstat(relpath, "adapter check")
    if found is None:
        return None
    if found.st_size > MAX_SOURCE_BYTES:
        raise NotUnderstood(
            f"{tree.root / relpath}: {found.st_size} bytes, larger than the "
            f"{MAX_SOURCE_BYTES} of any Python file patchkit reads ({why})",
            path=tree.root / relpath,
        )
    data = tree.fs.read(relpath, "adapter check")
    if data is None:
        return None
    try:
        parsed = ast.parse(data, filename=relpath)
    except (SyntaxError, ValueError) as exc:
        raise NotUnderstood(
            f"{tree.root / relpath}: not Python patchkit reads ({why}): {exc}",
            path=tree.root / relpath,
        ) from None
    except (RecursionError, MemoryError):  # the parser's own stack, past its bound
        parsed = None
    if parsed is None or _deeper(parsed, MAX_DEPTH):
        raise NotUnderstood(
            f"{tree.root / relpath}: not Python patchkit reads ({why}): nested deeper than "
            f"{MAX_DEPTH} (vLLM's own files: at most 30)",
            path=tree.root / relpath,
        )
    return parsed


def _deeper(node: ast.AST, bound: int) -> bool:
    """Whether the syntax tree is more than ``bound`` nodes deep (walked without recursion)."""
    todo = [(node, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > bound:
            return True
        todo.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return False


def module_file(tree: VllmTree, module: str) -> tuple[str, ast.Module | None]:
    """(relpath, syntax tree) of a dotted module: ``a/b.py``, else ``a/b/__init__.py``;
    the ``.py`` path and None when neither is there."""
    base = module.replace(".", "/")
    for relpath in (base + ".py", base + "/__init__.py"):
        parsed = parse(tree, relpath, f"module {module}")
        if parsed is not None:
            return relpath, parsed
    return base + ".py", None


def is_vllm_module(module: object) -> bool:
    parts = module.split(".") if isinstance(module, str) else []
    return len(parts) > 1 and parts[0] == "vllm" and all(p.isidentifier() for p in parts)


def served_class(tree: VllmTree, arch: str) -> Served | None:
    """The class vLLM serves for ``arch`` on CUDA; None when the registry does not name it."""
    registry = parse(tree, REGISTRY, "the model registry")
    if registry is None:
        raise NotUnderstood(f"{tree.root / REGISTRY} is missing", path=tree.root / REGISTRY)
    entry = _entries(registry, tree).get(arch)
    if entry is None:
        return None
    if not (
        isinstance(entry, tuple)
        and len(entry) == 2
        and all(isinstance(s, str) for s in entry)
        and entry[1].isidentifier()
    ):
        raise NotUnderstood(
            f"{tree.root / REGISTRY}: the entry for {arch} is not a (module, class) pair",
            path=tree.root / REGISTRY,
        )
    relname, cls = entry
    prefixed = _qualifies_vllm(registry) and relname.startswith("vllm.")
    module = relname if prefixed else f"{_MODELS_PACKAGE}.{relname}"
    if not is_vllm_module(module):
        raise NotUnderstood(
            f"{tree.root / REGISTRY}: the entry for {arch} names module {relname!r}, "
            "not a module under vllm/",
            path=tree.root / REGISTRY,
        )
    registered, via = module, []
    for _ in range(_MAX_HOPS + 1):
        relpath, parsed = module_file(tree, module)
        via.append(relpath)
        if parsed is None:
            raise NotUnderstood(
                f"{tree.root / relpath} is missing (the registry's module for {arch})",
                path=tree.root / relpath,
            )
        found = _binding(parsed.body, cls, tree, relpath)
        if found is None:
            raise NotUnderstood(
                f"{tree.root / relpath}: defines no class {cls} (the registry's class for {arch})",
                path=tree.root / relpath,
            )
        if isinstance(found, ast.ClassDef):
            return Served(arch, registered, cls, relpath, tuple(via))
        module, cls = _imported_module(found, relpath), found.names_map[cls]
        if not is_vllm_module(module):
            raise NotUnderstood(
                f"{tree.root / relpath}: imports {cls} from {module!r}, not a module under vllm/",
                path=tree.root / relpath,
            )
    raise NotUnderstood(
        f"{tree.root / via[-1]}: {arch}'s class is re-exported more than {_MAX_HOPS} times",
        path=tree.root / via[-1],
    )


def _entries(registry: ast.Module, tree: VllmTree) -> dict[str, object]:
    """``_VLLM_MODELS`` as the registry builds it: its ``**`` parts in order, later wins."""
    dicts: dict[str, ast.Dict] = {}
    for node in registry.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    dicts[target.id] = node.value
    if _ALL not in dicts:
        raise NotUnderstood(
            f"{tree.root / REGISTRY}: no {_ALL} dict patchkit reads", path=tree.root / REGISTRY
        )
    entries: dict[str, object] = {}
    _merge(dicts[_ALL], dicts, entries, set(), tree.root / REGISTRY)
    return entries


def _merge(node: ast.Dict, dicts: dict, entries: dict, seen: set[int], where) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    if len(seen) > MAX_CHAIN:
        raise NotUnderstood(f"{where}: {_ALL} merges more than {MAX_CHAIN} dicts", path=where)
    for key, value in zip(node.keys, node.values, strict=True):
        if key is None:  # **_TEXT_GENERATION_MODELS
            if isinstance(value, ast.Name) and value.id in dicts:
                _merge(dicts[value.id], dicts, entries, seen, where)
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            try:
                entries[key.value] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                entries[key.value] = None  # named, but not a pair: said by served_class


def _qualifies_vllm(registry: ast.Module) -> bool:
    """Whether the registry takes ``vllm.``-prefixed names as they are (_resolve_module_name);
    before 0.26.0 every name went under vllm.model_executor.models."""
    return any(
        isinstance(n, ast.FunctionDef) and n.name == "_resolve_module_name" for n in registry.body
    )


class _Import:
    """A ``from X import A as B`` that binds the name looked for."""

    def __init__(self, node: ast.ImportFrom, names_map: dict[str, str]):
        self.node, self.names_map = node, names_map


def _binding(body: list[ast.stmt], name: str, tree: VllmTree, relpath: str):
    """The last statement of ``body`` that binds ``name`` as a CUDA machine runs it:
    a ClassDef, an _Import, or None."""
    found = None
    for stmt in body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    found = _Import(stmt, {name: alias.name})
        elif isinstance(stmt, ast.If):
            inside = _binding(stmt.body, name, tree, relpath)
            other = _binding(stmt.orelse, name, tree, relpath)
            if inside is None and other is None:
                continue
            truth = _on_cuda(stmt.test)
            if truth is None:
                raise NotUnderstood(
                    f"{tree.root / relpath}: line {stmt.lineno}: cannot tell which branch of "
                    f"`if {ast.unparse(stmt.test)[:80]}` binds {name} on CUDA",
                    path=tree.root / relpath,
                )
            found = (inside if truth else other) or found
        elif isinstance(stmt, ast.Try):
            found = _binding(stmt.body, name, tree, relpath) or found
    return found


def _on_cuda(test: ast.expr) -> bool | None:
    """A platform test's value on a CUDA machine at run time; None when not one of those."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return False
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return False
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and not test.args:
        if test.func.attr in _CUDA_TRUE:
            return True
        if test.func.attr.startswith("is_"):  # is_rocm, is_cpu, is_xpu, is_tpu, ...
            return False
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        value = _on_cuda(test.operand)
        return None if value is None else not value
    if isinstance(test, ast.BoolOp):
        values = [_on_cuda(v) for v in test.values]
        if None in values:
            return None
        return any(values) if isinstance(test.op, ast.Or) else all(values)
    return None


def _imported_module(found: _Import, relpath: str) -> str:
    node = found.node
    if node.level == 0:
        return node.module or ""
    package = relpath.split("/")[:-1]  # a/b/c.py and a/b/__init__.py: package a/b
    if node.level - 1 >= len(package):
        return ""
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))
