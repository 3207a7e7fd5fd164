"""What one installed vLLM release does with an adapter's modules, read from its own files.

vLLM refuses an adapter (``LoRAModel.from_local_checkpoint``'s
check_unexpected_modules: "While loading ..., expected target modules in
... but received ...") whose module's last name is not one its LoRA code
wraps, expanded through the model's ``packed_modules_mapping``; an expert
module is judged by its name from ``experts`` on (``experts`` for the 3D
layout, ``experts.N.gate_proj`` for per-expert adapters, which a 3D model
(``is_3d_moe_weight = True``) accepts only in its 2D mapping). The wrapped
names are ``get_supported_lora_modules``': every LinearBase attribute and
every FusedMoE of the model. Nothing is imported: the release's model files
are parsed (ast) from the file that defines the class the release's registry
serves for the architecture on CUDA (:mod:`patchkit.adapters.registry`; 0.34.0:
``vllm/models/qwen3_5/nvidia/model.py``) along its imports from the model,
``vllm.models`` and mamba packages, two imports deep (``qwen3_5.py`` -> ``qwen3_next.py``,
``qwen2_moe.py`` -> the GDN layer file), and every ``self.NAME = ...Linear(...)`` (or a method that
returns one, as ``create_qkvz_proj``) and ``self.NAME = ...FusedMoE(...)``
is a wrapped name. That reads more classes than one model builds (the VL
tower's, a sibling model's), so the set can only be too large: a module it
calls refused is refused; one it lets pass may still be. The packed mapping is
the served class's own, looked up as Python does (the class, then its bases;
``Base.packed_modules_mapping | {...}`` evaluated); where none is defined or one
is not a literal patchkit evaluates, every mapping read, merged.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patchkit.adapters.registry import (
    MAX_CHAIN,
    NotUnderstood,
    Served,
    is_vllm_module,
    module_file,
    parse,
    served_class,
)
from patchkit.vllmtree.tree import VllmTree

# The architectures whose model files patchkit judges; the file is the one the release's own
# registry serves for each on CUDA (patchkit.adapters.registry).
ARCHITECTURES = frozenset(
    {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    }
)
_FOLLOWED = ("vllm.model_executor.models.", "vllm.model_executor.layers.mamba", "vllm.models.")
_MAX_FILES = 40  # 0.34.0: the nvidia model reads its kernels too before the VL towers
# the model file, the files it imports (qwen3_next.py), and theirs (the GDN layer)
_DEPTH = 2


@dataclass
class _Class:
    file: str
    bases: list[str]
    is_3d: bool  # is_3d_moe_weight = True in its body
    packed: ast.expr | None  # its packed_modules_mapping's value, unevaluated
    attrs: dict[str, ast.expr] = field(default_factory=dict)  # class-level NAME = value
    methods: dict[str, ast.FunctionDef] = field(default_factory=dict)


@dataclass
class LoraSupport:
    """The module names a release's LoRA loader accepts for one architecture."""

    files: list[str]  # the served class's file first, then what it imports
    wrapped: set[str]  # get_supported_lora_modules: attribute names
    packed: dict[str, list[str]]  # the served class's packed_modules_mapping
    is_3d: bool  # is_3d_moe_weight on the architecture's class or a base
    served: Served | None = None
    classes: dict[tuple[str, str], _Class] = field(default_factory=dict, repr=False)
    names: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict, repr=False)
    modules: dict[str, str] = field(default_factory=dict, repr=False)  # dotted -> relpath
    # every `self.ATTR = CALLEE(...)` in a class body: (class, attr, callee), for the
    # layers that share a wrapped name but are no LoRA layer (patchkit.adapters.reach)
    built: list[tuple[str, str, str]] = field(default_factory=list, repr=False)
    factories: set[str] = field(default_factory=set, repr=False)  # functions returning a Linear

    def expected(self) -> set[str]:
        """worker_manager's expected_lora_modules."""
        names: set[str] = set()
        for module in self.wrapped:
            names.update(self.packed.get(module, [module]))
            if module == "experts":
                names.add(module)
        return names

    def refuses(self, module: str) -> bool:
        """check_unexpected_modules on one module name (the key's, prefix stripped)."""
        expected = self.expected()
        at = module.find(".experts")
        if at >= 0:
            suffix = module[at + 1 :]
            if not self.is_3d and suffix.split(".")[-1] in expected and "experts" in expected:
                # the 2D mapping lists experts.N.<proj> for every expert N
                return False
            return suffix not in expected
        return module.rsplit(".", 1)[-1] not in expected


def lora_support(tree: VllmTree, arch: str) -> LoraSupport | None:
    """The names for ``arch`` from the model files the tree's registry serves on CUDA; None
    for a model this file does not judge or the registry does not name (the caller says the
    check was skipped)."""
    if arch not in ARCHITECTURES:
        return None
    served = served_class(tree, arch)
    if served is None:
        return None
    todo, seen = [(served.file, 0)], []
    support = LoraSupport([], set(), {}, False, served)
    merged: dict[str, list[str]] = {}
    while todo and len(seen) < _MAX_FILES:
        target, depth = todo.pop(0)
        if target.endswith(".py"):  # the served file, found by the registry
            relpath, module = target, parse(tree, target, "a model file")
        else:
            relpath, module = module_file(tree, target)
            support.modules[target] = relpath
        if relpath in seen:
            continue
        if module is None:  # a partial tree: judging by fewer files would refuse wrongly
            raise NotUnderstood(f"{tree.root / relpath} is missing", path=tree.root / relpath)
        seen.append(relpath)
        _read(module, relpath, support, merged)
        if depth < _DEPTH:
            todo += [(m, depth + 1) for m in _imports(module, relpath, support)]
    support.files = seen
    try:
        key = _lookup(support, served.file, served.cls, set())
        packed = _packed(support, key, set()) if key else None
        support.is_3d = _is_3d(support, key, set()) if key else False
    except _TooLong as exc:
        raise NotUnderstood(
            f"{tree.root / exc.relpath}: {exc.what} followed past {MAX_CHAIN} steps; not a "
            "model file patchkit reads",
            path=tree.root / exc.relpath,
        ) from None
    except RecursionError:  # each step bounded, their product not: mappings built on bases'
        raise NotUnderstood(
            f"{tree.root / served.file}: the packed_modules_mapping of {served.cls} is built "
            "through more classes and expressions than patchkit follows",
            path=tree.root / served.file,
        ) from None
    # no mapping of its own or its bases' (vLLM then merges its children's), or one patchkit
    # cannot evaluate: every mapping read, merged, as the set can only grow
    support.packed = packed or merged
    return support


class _TooLong(Exception):
    """A chain of imports or base classes longer than MAX_CHAIN (each step recurses)."""

    def __init__(self, relpath: str, what: str):
        super().__init__(what)
        self.relpath, self.what = relpath, what


def _step(seen: set, relpath: str, what: str) -> None:
    if len(seen) > MAX_CHAIN:
        raise _TooLong(relpath, what)


def _imports(module: ast.Module, relpath: str, support: LoraSupport) -> list[str]:
    """The model and mamba-layer modules a model file imports from (dotted names); the names
    it binds from them are kept for finding its base classes."""
    found, names = [], support.names.setdefault(relpath, {})
    for node in module.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            package = relpath.split("/")[:-1]
            if node.level - 1 >= len(package):
                continue
            package = package[: len(package) - (node.level - 1)]
            dotted = ".".join(package + ([node.module] if node.module else []))
        else:
            dotted = node.module or ""
        followed = node.level or dotted.startswith(_FOLLOWED)
        if not node.module or not followed or not is_vllm_module(dotted):
            continue
        for alias in node.names:
            names.setdefault(alias.asname or alias.name, (dotted, alias.name))
        found.append(dotted)
    return found


def _callee(call: ast.expr) -> str:
    if not isinstance(call, ast.Call):
        return ""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _read(module: ast.Module, relpath: str, support: LoraSupport, merged: dict) -> None:
    factories = {
        node.name
        for node in ast.walk(module)
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(r, ast.Return) and _callee(r.value).endswith("Linear")
            for r in ast.walk(node)
        )
    }
    support.factories |= factories
    for node in ast.walk(module):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                _assignment(target, node.value, factories, support, merged)
        if isinstance(node, ast.ClassDef):
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            ]
            attrs, methods = {}, {}
            for s in node.body:
                if isinstance(s, ast.FunctionDef):
                    methods[s.name] = s
                if not isinstance(s, (ast.Assign, ast.AnnAssign)) or s.value is None:
                    continue
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                attrs.update((t.id, s.value) for t in targets if isinstance(t, ast.Name))
            flag = attrs.get("is_3d_moe_weight")
            flag = isinstance(flag, ast.Constant) and flag.value is True
            packed = attrs.get("packed_modules_mapping")
            support.classes[(relpath, node.name)] = _Class(
                relpath, bases, flag, packed, attrs, methods
            )
            support.built += _built(node)


def _built(cls: ast.ClassDef) -> list[tuple[str, str, str]]:
    """(class, attr, callee) of every `self.ATTR = CALLEE(...)` in the class."""
    found = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.append((cls.name, target.attr, _callee(node.value)))
    return found


def class_attribute(support: LoraSupport, name: str, kind: str = "attrs"):
    """(file, value) of the served class's attribute (``kind`` "methods": a method) as
    Python finds it: the class, then its bases, left first; None where none defines it."""
    if support.served is None:
        return None
    key = _lookup(support, support.served.file, support.served.cls, set())
    return _attribute(support, key, name, kind, set()) if key else None


def _attribute(support: LoraSupport, key: tuple, name: str, kind: str, seen: set):
    if key in seen:
        return None
    seen.add(key)
    _step(seen, key[0], f"the bases of {key[1]}")
    cls = support.classes[key]
    found = getattr(cls, kind).get(name)
    if found is not None:
        return cls.file, found
    for base in cls.bases:
        parent = _lookup(support, cls.file, base, set())
        value = _attribute(support, parent, name, kind, seen) if parent else None
        if value is not None:
            return value
    return None


def lookup_class(support: LoraSupport, relpath: str, name: str) -> tuple | None:
    """The (file, class) a name means in a file (defined there or imported from a file read)."""
    return _lookup(support, relpath, name, set())


def _assignment(target, value, factories: set[str], support: LoraSupport, merged: dict) -> None:
    if value is None:
        return
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        if target.value.id == "self":
            name = _callee(value)
            if name.endswith("Linear") or name in factories or "FusedMoE" in name:
                support.wrapped.add(target.attr)
            return
    names = {getattr(target, "id", None), getattr(target, "attr", None)}
    if "packed_modules_mapping" in names:
        for node in ast.walk(value):
            if isinstance(node, ast.Dict):
                _merge_into(merged, _literal(node) or {})
    if "embedding_modules" in names and isinstance(value, ast.Dict):
        support.wrapped.update(k.value for k in value.keys if isinstance(k, ast.Constant))


def _literal(node: ast.Dict) -> dict[str, list[str]] | None:
    """A dict literal's ``"name": ["member", ...]`` items; None when it is not only those."""
    try:
        literal = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    if not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(m, str) for m in v)
        for k, v in literal.items()
    ):
        return None
    return literal


def _merge_into(merged: dict[str, list[str]], mapping: dict[str, list[str]]) -> None:
    for key, members in mapping.items():
        into = merged.setdefault(key, [])
        into += [m for m in members if m not in into]


def _lookup(support: LoraSupport, relpath: str, name: str, seen: set) -> tuple | None:
    """The class ``name`` means in ``relpath``: defined there, imported by it from a file
    read, else the first class of that name read."""
    if (relpath, name) in seen:
        return None
    seen.add((relpath, name))
    _step(seen, relpath, f"the imports of {name}")
    if (relpath, name) in support.classes:
        return (relpath, name)
    source = support.names.get(relpath, {}).get(name)
    if source is not None and source[0] in support.modules:
        found = _lookup(support, support.modules[source[0]], source[1], seen)
        if found is not None:
            return found
    return next((key for key in support.classes if key[1] == name), None)


def _packed(support: LoraSupport, key: tuple, seen: set) -> dict[str, list[str]] | None:
    """The class's packed_modules_mapping as Python looks it up (its own, else its bases',
    left first); {} when none defines one, None when one patchkit cannot evaluate does."""
    if key in seen:
        return {}
    seen.add(key)
    _step(seen, key[0], f"the bases of {key[1]}")
    cls = support.classes[key]
    if cls.packed is not None:
        return _evaluate(support, cls.file, cls.packed, seen)
    for base in cls.bases:
        found = _lookup(support, cls.file, base, set())
        value = _packed(support, found, seen) if found else {}
        if value != {}:
            return value
    return {}


def _evaluate(support: LoraSupport, relpath: str, node: ast.expr, seen: set):
    """``{...}``, ``Base.packed_modules_mapping``, ``{**a, ...}`` and ``a | b`` of those."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left = _evaluate(support, relpath, node.left, seen)
        right = _evaluate(support, relpath, node.right, seen)
        return None if left is None or right is None else left | right
    if isinstance(node, ast.Attribute) and node.attr == "packed_modules_mapping":
        if isinstance(node.value, ast.Name):
            found = _lookup(support, relpath, node.value.id, set())
            return _packed(support, found, seen) if found else None
        return None
    if isinstance(node, ast.Dict):
        result: dict[str, list[str]] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                part = _evaluate(support, relpath, value, seen)
            else:
                part = _literal(ast.Dict(keys=[key], values=[value]))
            if part is None:
                return None
            result |= part
        return result
    return None


def _is_3d(support: LoraSupport, key: tuple, seen: set) -> bool:
    if key in seen:
        return False
    seen.add(key)
    _step(seen, key[0], f"the bases of {key[1]}")
    cls = support.classes[key]
    if cls.is_3d:
        return True
    for base in cls.bases:
        found = _lookup(support, cls.file, base, set())
        if found is not None and _is_3d(support, found, seen):
            return True
    return False
