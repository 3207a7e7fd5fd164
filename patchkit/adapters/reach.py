"""Which of an adapter's modules one vLLM release's LoRA code reaches, read from its files.

vLLM loads an adapter by name (``LoRAModel.from_local_checkpoint``): each
tensor's name loses ``base_model.model.``, goes through the served class's
``hf_to_vllm_mapper`` (a WeightsMapper, in the variant the release's
``worker_manager.py`` asks for: whole before 0.25.0, ``get_unstacked_mapper``
0.25-0.28, ``get_rename_mapper`` from 0.29.0, which also drops maps to None),
and is refused when its last name is not one the LoRA code wraps
(:mod:`patchkit.adapters.release`). Whatever passes is loaded; at activation
every wrapped module looks up the weights under its own name, and weights
under a name no wrapped module has are never looked up: that module serves
as the base model, with a debug line at most ("No LoRA weights found for
module"; 0.34.0: "No LoRA weights were applied ... Requests may use the base
model", debug too). An adapter none of whose modules is reached is served as
its base model (vLLM #34186: an adapter trained on the text-only Qwen3.5,
``model.layers.N``, served on the multimodal one, whose language model vLLM
names ``language_model.model.layers.N``). 0.34.0 adds one refusal
(``unsupported_lora_modules``): a module whose name is a layer of the model
that shares a wrapped name but is no LoRA layer (the vision tower's Conv3d
``patch_embed.proj``), where LoRA is on for it.

Read from the tree: the mapper (the served class's ``hf_to_vllm_mapper``,
evaluated from its ``WeightsMapper(...)`` literals, ``A.hf_to_vllm_mapper | ...``
and its bases'), the variant, ``lora_skip_prefixes``, ``get_mm_mapping``'s
language model, tower and connector, the ``enable_tower_connector_lora``
option, whether ``from_local_checkpoint`` has ``unsupported_lora_modules``,
and the layers that share a wrapped name but are built by another class. Not
from the tree: how transformers names the checkpoint of each architecture
(HF_LANGUAGE_MODEL), which is the model's, not the release's.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from patchkit.adapters.registry import NotUnderstood, parse
from patchkit.adapters.release import LoraSupport, class_attribute, lookup_class
from patchkit.codes import Code, Reason
from patchkit.vllmtree.tree import VllmTree

# Where transformers puts each architecture's language model in its checkpoint, and so
# in the names PEFT writes under base_model.model. (the model's layout, not the release's).
HF_LANGUAGE_MODEL = {
    "Qwen3_5ForConditionalGeneration": "model.language_model.",
    "Qwen3_5MoeForConditionalGeneration": "model.language_model.",
    "Qwen3_5ForCausalLM": "model.",
    "Qwen3_5MoeForCausalLM": "model.",
    "Qwen3NextForCausalLM": "model.",
}
WORKER_MANAGER = "vllm/lora/worker_manager.py"
LORA_MODEL = "vllm/lora/lora_model.py"
LORA_CONFIG = "vllm/config/lora.py"
WEIGHTS_MAPPER_FILE = "vllm/model_executor/models/utils.py"
MAPS = ("substr", "stacked", "prefix", "suffix")  # _map_name's order, after regex/renaming
VARIANTS = ("get_unstacked_mapper", "get_rename_mapper")
TOWER_OPTION = "enable_tower_connector_lora"
_LAYER_INDEX = re.compile(r"\.layers\.([0-9]{1,9})\.")
# what the callee of a layer vLLM wraps (or skips by its own rule) holds in its name: the
# linear and MoE layers, the embeddings and head, a pipeline stage's placeholder, a head
# tied to the embeddings (an alias, wrapped once)
LORA_LAYERS = ("Linear", "FusedMoE", "Embedding", "LMHead", "PPMissingLayer", "tie_weights")


@dataclass
class Mapper:
    """A WeightsMapper's maps, applied as ``_map_name`` applies them."""

    substr: dict = field(default_factory=dict)
    stacked: dict = field(default_factory=dict)
    prefix: dict = field(default_factory=dict)
    suffix: dict = field(default_factory=dict)

    def __or__(self, other: Mapper) -> Mapper:
        return Mapper(*({**getattr(self, m), **getattr(other, m)} for m in MAPS))

    def map(self, key: str) -> str | None:
        """The mapped name; None where a map sends it to None (vLLM: "Mapped LoRA weight
        name cannot be None", the adapter refused)."""
        for substr, new in self.substr.items():
            if substr in key:
                if new is None:
                    return None
                key = key.replace(substr, new, 1)
        for substr, (new, _shard) in self.stacked.items():
            if substr in key:
                key = key.replace(substr, new, 1)
        for prefix, new in self.prefix.items():
            if key.startswith(prefix):
                if new is None:
                    return None
                key = key.replace(prefix, new, 1)
        for suffix, new in self.suffix.items():
            if key.endswith(suffix):
                if new is None:
                    return None
                key = key[: -len(suffix)] + new
        return key


@dataclass
class Layout:
    """What one release makes of one architecture's module names."""

    version: str
    arch: str
    served: str  # the class the registry serves
    mapper: Mapper
    layers: str  # vLLM's name of the language model's layers, up to "layers."
    tops: set[str]  # the language model's embeddings and head, as vLLM names them
    tower: list[str]  # prefixes of the vision tower and connector (multimodal models)
    tower_option: bool  # the release has --enable-tower-connector-lora
    refuses_non_lora: bool  # 0.34.0's unsupported_lora_modules
    non_lora: list[str]  # "parent.attr" of layers with a wrapped name that are no LoRA layer
    skip: list[str]  # lora_skip_prefixes


@dataclass(frozen=True)
class Reach:
    """One adapter module on one release: wrapped, ignored or refused, and why."""

    module: str  # the adapter's name, under base_model.model.
    vllm_module: str | None  # the name vLLM looks it up under (None: mapped to nothing)
    outcome: str  # wrapped, ignored, refused
    why: Reason  # a reach-* code and its facts (words: patchkit.cli.adapter_target_words)


def layout(tree: VllmTree, support: LoraSupport, arch: str) -> Layout:
    """The release's reading of ``arch``; NotUnderstood names the file patchkit cannot read."""
    mapper = lora_mapper(tree, support)
    hf = HF_LANGUAGE_MODEL[arch]
    layers = mapper.map(hf + "layers.") or hf + "layers."
    tops = {module_name(mapper, hf + "embed_tokens"), module_name(mapper, "lm_head")} - {None}
    keys = mm_keys(support)
    return Layout(
        version=tree.version,
        arch=arch,
        served=support.served.cls if support.served else arch,
        mapper=mapper,
        layers=layers,
        tops=tops,
        tower=[p for key in ("tower_model", "connector") for p in keys.get(key, [])],
        tower_option=_mentions(tree, LORA_CONFIG, TOWER_OPTION),
        refuses_non_lora=_mentions(tree, LORA_MODEL, "unsupported_lora_modules"),
        non_lora=non_lora_layers(support),
        skip=_strings(_attribute_value(support, "lora_skip_prefixes")) or [],
    )


def reach(module: str, lay: Layout, support: LoraSupport) -> Reach:
    """Where one adapter module ends on the release (``module``: the name PEFT wrote, less
    ``base_model.model.``)."""
    name = module
    while name.endswith(".base_layer"):  # PEFT's nesting of fused experts: vLLM looks up
        name = name.removesuffix(".base_layer")  # the experts' name with it (gate_up_proj)
    nested = module[len(name) :]
    if any(f".{p}" in f"base_model.model.{module}" or module.startswith(p) for p in lay.skip):
        return Reach(module, None, "ignored", Reason.of(Code.REACH_SKIP_PREFIX))
    mapped = module_name(lay.mapper, name)
    if mapped is None:
        return Reach(module, None, "refused", Reason.of(Code.REACH_MAPS_TO_NOTHING))
    if support.refuses(name):
        return Reach(module, mapped, "refused", Reason.of(Code.REACH_NO_WRAPPED_NAME))
    non_lora = next((n for n in lay.non_lora if mapped.endswith("." + n)), None)
    in_lm = mapped.startswith(lay.layers) or mapped in lay.tops
    if in_lm and non_lora and lay.refuses_non_lora:
        return Reach(
            module, mapped, "refused", Reason.of(Code.REACH_NOT_LORA_LAYER, layer=non_lora)
        )
    if in_lm:
        packed = Reason.of(Code.REACH_WRAPPED, packed=_packed_in(mapped, support))
        return Reach(module, mapped + nested, "wrapped", packed)
    if any(mapped.startswith(p) for p in lay.tower):
        refused = non_lora if non_lora and lay.refuses_non_lora and lay.tower_option else None
        why = Reason.of(Code.REACH_VISION_TOWER, option=lay.tower_option, refused_layer=refused)
        return Reach(module, mapped, "ignored", why)
    why = Reason.of(Code.REACH_NOT_IN_MODEL, served=lay.served, layers=lay.layers)
    return Reach(module, mapped, "ignored", why)


def grouped(rows: list[dict]) -> list[tuple[str, str, str, Reason]]:
    """(name with its layer as N, the layers, outcome, why) per target, in first-seen order:
    one line per target name instead of one per layer (a why holds no layer's number)."""
    groups: dict[tuple, list[int]] = {}
    for row in rows:
        match = _LAYER_INDEX.search(row["module"])
        name = _LAYER_INDEX.sub(".layers.N.", row["module"], count=1) if match else row["module"]
        layers = groups.setdefault((name, row["outcome"], row["why"]), [])
        if match:
            layers.append(int(match[1]))
    return [(name, _spans(layers), outcome, why) for (name, outcome, why), layers in groups.items()]


def _spans(numbers: list[int]) -> str:
    """ "layers 0-2, 5" for [0, 1, 2, 5]; "" for none."""
    if not numbers:
        return ""
    numbers, spans = sorted(set(numbers)), []
    start = prev = numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return f"layer{'s' if len(numbers) > 1 else ''} {', '.join(spans)}"


def module_name(mapper: Mapper, module: str) -> str | None:
    """The module name vLLM files a module's weights under: its lora_A tensor's name mapped
    (the maps apply to tensor names: `lm_head.` matches `lm_head.lora_A.weight`), the
    factor's part cut again; None where it maps to nothing."""
    mapped = mapper.map(f"{module}.lora_A.weight")
    if mapped is None:
        return None
    return mapped.removesuffix(".lora_A.weight")


def _packed_in(mapped: str, support: LoraSupport) -> str | None:
    """`qkv_proj` for a member of a packed module, else None."""
    last = mapped.rsplit(".", 1)[-1]
    packed = next((k for k, members in support.packed.items() if last in members), None)
    return packed if packed and packed != last else None


# ----- reading the release -----


def lora_mapper(tree: VllmTree, support: LoraSupport) -> Mapper:
    """The served class's hf_to_vllm_mapper in the variant the LoRA loader uses."""
    found = class_attribute(support, "hf_to_vllm_mapper")
    mapper = Mapper() if found is None else _mapper(support, found[0], found[1], set())
    drops = variant_drops(tree)
    if "stacked" in drops:
        mapper.stacked = {}
    for name in MAPS:
        if f"{name}:none" in drops:
            setattr(mapper, name, {k: v for k, v in getattr(mapper, name).items() if v})
    return mapper


def _mapper(support: LoraSupport, relpath: str, node: ast.expr, seen: set) -> Mapper:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left = _mapper(support, relpath, node.left, seen)
        return left | _mapper(support, relpath, node.right, seen)
    if (
        isinstance(node, ast.Attribute)
        and node.attr == "hf_to_vllm_mapper"
        and isinstance(node.value, ast.Name)
    ):
        key = lookup_class(support, relpath, node.value.id)
        if key is None or key in seen or len(seen) > 16:
            raise NotUnderstood(
                f"{relpath}: {ast.unparse(node)} is not a class patchkit read", path=relpath
            )
        seen.add(key)
        found = _own_or_base(support, key, set())
        if found is None:
            return Mapper()
        return _mapper(support, found[0], found[1], seen)
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "WeightsMapper":
        return _weights_mapper(relpath, node)
    raise NotUnderstood(
        f"{relpath}: line {node.lineno}: a hf_to_vllm_mapper patchkit cannot read", path=relpath
    )


def _own_or_base(support: LoraSupport, key: tuple, seen: set):
    """(file, value) of hf_to_vllm_mapper on the class ``key`` or its bases."""
    if key in seen:
        return None
    seen.add(key)
    cls = support.classes[key]
    if "hf_to_vllm_mapper" in cls.attrs:
        return cls.file, cls.attrs["hf_to_vllm_mapper"]
    for base in cls.bases:
        parent = lookup_class(support, cls.file, base)
        found = _own_or_base(support, parent, seen) if parent else None
        if found is not None:
            return found
    return None


def _weights_mapper(relpath: str, node: ast.Call) -> Mapper:
    mapper = Mapper()
    for keyword in node.keywords:
        what = (keyword.arg or "").removeprefix("orig_to_new_")
        try:
            value = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            value = None
        if what in MAPS and isinstance(value, dict):
            setattr(mapper, what, value)
        elif value not in ({}, []):  # regex, renaming: patterns and objects, not read here
            raise NotUnderstood(
                f"{relpath}: line {node.lineno}: WeightsMapper({keyword.arg}=...) is not a "
                "map patchkit applies",
                path=relpath,
            )
    return mapper


def variant_drops(tree: VllmTree) -> set[str]:
    """What the LoRA loader's variant of the mapper leaves out: "stacked", and
    "<map>:none" for each map whose entries to None it drops."""
    loader = _source(tree, WORKER_MANAGER)
    called = {
        n.func.attr
        for n in ast.walk(loader)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    variant = next((v for v in VARIANTS if v in called), None)
    if variant is None:
        return set()
    utils = _source(tree, WEIGHTS_MAPPER_FILE)
    method = next(
        (n for n in ast.walk(utils) if isinstance(n, ast.FunctionDef) and n.name == variant),
        None,
    )
    call = next(
        (
            n
            for n in ast.walk(method)
            if method
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "replace"
        ),
        None,
    )
    if call is None:
        raise NotUnderstood(
            f"{tree.root / WEIGHTS_MAPPER_FILE}: {variant} is not a replace()",
            path=tree.root / WEIGHTS_MAPPER_FILE,
        )
    drops = set()
    for keyword in call.keywords:
        what = (keyword.arg or "").removeprefix("orig_to_new_")
        if what == "stacked":
            drops.add("stacked")
        elif what in MAPS and isinstance(keyword.value, ast.Call):  # remove_none(...)
            drops.add(f"{what}:none")
    return drops


def mm_keys(support: LoraSupport) -> dict[str, list[str]]:
    """get_mm_mapping's MultiModelKeys.from_string_field(...) literals: {} for a text model."""
    found = class_attribute(support, "get_mm_mapping", "methods")
    if found is None:
        return {}
    keys: dict[str, list[str]] = {}
    for node in ast.walk(found[1]):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_string_field":
            for keyword in node.keywords:
                keys[keyword.arg or ""] = _strings(keyword.value) or []
    return keys


def non_lora_layers(support: LoraSupport) -> list[str]:
    """ "parent.attr" of each layer whose attribute name is a wrapped one but whose class is
    no LoRA layer (the Conv3d ``proj`` of Qwen3-VL's patch embedding): 0.34.0 refuses LoRA
    on them where LoRA is on for their part of the model."""
    odd = {
        (cls, attr)
        for cls, attr, callee in support.built
        if attr in support.wrapped
        and callee
        and not any(kind in callee for kind in LORA_LAYERS)
        and callee not in support.factories
    }
    odd_classes = {cls for cls, _ in odd}
    found = []
    for _owner, attr, callee in support.built:
        if callee in odd_classes:
            found += [f"{attr}.{inner}" for owner, inner in sorted(odd) if owner == callee]
    return sorted(set(found))


def _attribute_value(support: LoraSupport, name: str):
    found = class_attribute(support, name)
    return found[1] if found else None


def _strings(node) -> list[str] | None:
    """A literal string or list of strings as a list; None otherwise."""
    try:
        value = ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _source(tree: VllmTree, relpath: str) -> ast.Module:
    parsed = parse(tree, relpath, "vLLM's LoRA loader")
    if parsed is None:
        raise NotUnderstood(f"{tree.root / relpath} is missing", path=tree.root / relpath)
    return parsed


def _mentions(tree: VllmTree, relpath: str, name: str) -> bool:
    """Whether the file names ``name`` (an option, a parameter): read, not searched as text."""
    parsed = _source(tree, relpath)
    return any(
        (isinstance(n, ast.arg) and n.arg == name)
        or (isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == name)
        for n in ast.walk(parsed)
    )
