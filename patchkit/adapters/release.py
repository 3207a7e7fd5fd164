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
are parsed (ast) from the model's file along its imports from the model and
mamba packages, two imports deep (``qwen3_5.py`` -> ``qwen3_next.py``,
``qwen2_moe.py`` -> the GDN layer file), and every ``self.NAME = ...Linear(...)`` (or a method that
returns one, as ``create_qkvz_proj``) and ``self.NAME = ...FusedMoE(...)``
is a wrapped name. That reads more classes than one model builds (the VL
tower's, a sibling model's), so the set can only be too large: a module it
calls refused is refused; one it lets pass may still be.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patchkit.errors import PatchkitError
from patchkit.vllmtree.tree import VllmTree

MODEL_FILES = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
}
MODELS = "vllm/model_executor/models/"
_FOLLOWED = ("vllm.model_executor.models.", "vllm.model_executor.layers.mamba")
_MAX_FILES = 24
# the model file, the files it imports (qwen3_next.py), and theirs (the GDN layer)
_DEPTH = 2


@dataclass
class LoraSupport:
    """The module names a release's LoRA loader accepts for one architecture."""

    files: list[str]
    wrapped: set[str]  # get_supported_lora_modules: attribute names
    packed: dict[str, list[str]]  # packed_modules_mapping (every class read, merged)
    is_3d: bool  # is_3d_moe_weight on the architecture's class or a base
    classes: dict[str, tuple[list[str], bool]] = field(default_factory=dict, repr=False)

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
    """The names for ``arch`` from the tree's model files; None for a model this file
    does not know (the caller says the check was skipped)."""
    start = MODEL_FILES.get(arch)
    if start is None:
        return None
    todo, seen = [(MODELS + start + ".py", 0)], []
    support = LoraSupport([], set(), {}, False)
    while todo and len(seen) < _MAX_FILES:
        relpath, depth = todo.pop(0)
        if relpath in seen:
            continue
        seen.append(relpath)
        data = tree.fs.read(relpath, "adapter check")
        if data is None:  # a partial tree: judging by fewer files would refuse wrongly
            raise PatchkitError(f"{tree.root / relpath} is missing")
        try:
            module = ast.parse(data, filename=relpath)
        except (SyntaxError, ValueError) as exc:
            raise PatchkitError(
                f"{tree.root / relpath}: not Python patchkit reads: {exc}"
            ) from None
        _read(module, support)
        if depth < _DEPTH:
            todo += [(p, depth + 1) for p in _imports(module) if p not in seen]
    support.files = seen
    support.is_3d = _is_3d(support.classes, arch, set())
    return support


def _imports(module: ast.Module) -> list[str]:
    """The model and mamba-layer files a model file imports from."""
    found = []
    for node in module.body:
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.level == 1:
            found.append(MODELS + node.module.replace(".", "/") + ".py")
        elif node.level == 0 and node.module.startswith(_FOLLOWED):
            found.append(node.module.replace(".", "/") + ".py")
    return found


def _callee(call: ast.expr) -> str:
    if not isinstance(call, ast.Call):
        return ""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _read(module: ast.Module, support: LoraSupport) -> None:
    factories = {
        node.name
        for node in ast.walk(module)
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(r, ast.Return) and _callee(r.value).endswith("Linear")
            for r in ast.walk(node)
        )
    }
    for node in ast.walk(module):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                _assignment(target, node.value, factories, support)
        if isinstance(node, ast.ClassDef):
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            ]
            flag = any(
                isinstance(s, (ast.Assign, ast.AnnAssign))
                and "is_3d_moe_weight" in ast.unparse(s).split("=")[0]
                and isinstance(s.value, ast.Constant)
                and s.value.value is True
                for s in node.body
            )
            support.classes[node.name] = (bases, flag)


def _assignment(target, value, factories: set[str], support: LoraSupport) -> None:
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
                try:
                    literal = ast.literal_eval(node)
                except ValueError:
                    continue
                for key, members in literal.items():
                    if isinstance(key, str) and isinstance(members, list):
                        merged = support.packed.setdefault(key, [])
                        merged += [m for m in members if m not in merged]
    if "embedding_modules" in names and isinstance(value, ast.Dict):
        support.wrapped.update(k.value for k in value.keys if isinstance(k, ast.Constant))


def _is_3d(classes: dict, name: str, seen: set[str]) -> bool:
    if name not in classes or name in seen:
        return False
    seen.add(name)
    bases, flag = classes[name]
    return flag or any(_is_3d(classes, base, seen) for base in bases)
