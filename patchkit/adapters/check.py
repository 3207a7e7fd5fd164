"""`patchkit adapter check`: a PEFT LoRA adapter judged before any server loads it.

``check(adapter_dir, model_dir, target, max_rank)`` reads the adapter's
adapter_config.json (:mod:`patchkit.adapters.adapterconfig`, the reader and
rule `verify` refuses by) and the header of adapter_model.safetensors, scans
every tensor of every floating type vLLM loads for NaN/Inf
(:mod:`patchkit.adapters.nonfinite`, in chunks; any other type is a finding,
never read), and, given the model's config.json, the shapes of every factor
(:mod:`patchkit.adapters.modelshapes`); given a vLLM tree, what that release
would refuse or ignore (:mod:`patchkit.adapters.release` and the catalogue's
patch states). Everything is a :class:`AdapterFinding` naming the file and the
tensor; nothing imports torch or vLLM, nothing is written.

The scale range. vLLM multiplies B @ A by lora_alpha / r (rsLoRA: lora_alpha
/ sqrt(r)). Accepted: 1/64 <= scale <= 16. PEFT's default (r 8, alpha 8) is 1;
the common recipes are alpha = r or 2r (1 or 2), QLoRA's r 64, alpha 16 is
0.25, rsLoRA's alpha 16 at r 64 is 2. A scale of 16 (alpha = 16 r, e.g. r 8,
alpha 128) is already eight times the largest recipe, and beyond it a bf16
delta of trained factors easily exceeds the base weights; below 1/64 (alpha 1
at r 128) the adapter moves the outputs by a few percent of what it learned,
which in practice is alpha taken for the scale (alpha 1 meaning "scale 1").
Zero or negative alpha makes the adapter a no-op or flips its sign.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.adapters import adapterconfig, nonfinite, reach, targetcheck
from patchkit.adapters.adapterconfig import AdapterConfig
from patchkit.adapters.directory import Directory, about
from patchkit.adapters.modelshapes import EXPERT_PARAMS, ModelShapes, architecture, model_shapes
from patchkit.adapters.names import (
    ADAPTER_CONFIG,
    ADAPTER_SAFETENSORS,
    NO_INDEX,
    PEFT_PREFIX,
    PICKLES,
    index,
    layer_and_name,
)
from patchkit.adapters.report import Kind, Report
from patchkit.adapters.safetensorsfile import SafetensorsFile, TensorInfo, shown
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError

SCALE_RANGE = (1 / 64, 16.0)


@dataclass
class Factors:
    """One adapter module: its lora_A and lora_B (or lora_embedding_A/B) headers."""

    module: str  # the name under base_model.model.
    embedding: bool = False
    a: TensorInfo | None = None
    b: TensorInfo | None = None


@dataclass
class _Adapter:
    config: AdapterConfig  # adapterconfig.read's: every value that passed the rule
    modules: dict[str, Factors] = field(default_factory=dict)
    refused_keys: set[str] = field(default_factory=set)  # pattern keys already said
    zero: set[str] = field(default_factory=set)  # tensors whose every value is 0

    def key_refused(self, exc: adapterconfig.PatternRefused, report: Report) -> None:
        """A pattern key whose matching ran past its work bound: one finding, however many
        modules were matched against it."""
        if exc.problem.message not in self.refused_keys:
            self.refused_keys.add(exc.problem.message)
            report.add(Kind.CONFIG, ADAPTER_CONFIG, exc.problem.key, exc.problem.message)


def check(
    adapter_dir: Path | str,
    model_dir: Path | str | None = None,
    target=None,
    max_rank: int | None = None,
) -> Report:
    """Every problem of one adapter, as typed findings.

    ``target`` is a located :class:`patchkit.vllmtree.tree.VllmTree` (or None);
    ``verify --model`` calls this first and reports the findings as rows.
    A directory that cannot be opened at all raises PatchkitError.
    """
    adapter_dir = Path(adapter_dir)
    report = Report(
        str(adapter_dir),
        str(model_dir) if model_dir else None,
        str(target.root) if target else None,
        vllm_version=target.version if target else None,
    )
    with Directory(adapter_dir) as folder:
        adapter = _read_config(folder, report, max_rank)
        st = _open_weights(folder, report)
        if st is not None:
            with st:
                _read_tensors(st, adapter, report)
                _check_pairs(adapter, report, max_rank)
                _check_effect(adapter, report)
    shapes, arch = None, ""
    if model_dir is None:
        report.skipped.append(Reason.of(Code.ADAPTER_SKIPPED_NO_MODEL))
    else:
        shapes, arch = _model(Path(model_dir), report)
        if shapes is not None:
            _check_model(adapter, shapes, report)
    if target is None:
        report.skipped.append(Reason.of(Code.ADAPTER_SKIPPED_NO_TARGET))
        _other_layout(adapter, arch, report)
    else:
        targetcheck.check_release(adapter, shapes, arch, target, report)
    return report


# ----- adapter_config.json -----


def _read_config(folder: Directory, report: Report, max_rank: int | None) -> _Adapter:
    """The shared reader's problems as findings (patchkit.adapters.adapterconfig: verify
    refuses on the same ones), then what only this check judges: --max-lora-rank and the
    scale."""
    config = adapterconfig.read(folder)
    for problem in config.problems:
        report.add(Kind.CONFIG, ADAPTER_CONFIG, problem.key, problem.message)
    adapter = _Adapter(config)
    if max_rank is not None:
        _rank_limit(config, max_rank, report)
    if config.r is not None and config.alpha is not None:
        _check_scale(report, config.r, config.alpha, config.use_rslora, None)
        for name, a in config.alpha_pattern.items():
            _check_scale(report, config.r, a, config.use_rslora, name)
    return adapter


def _rank_limit(config: AdapterConfig, max_rank: int, report: Report) -> None:
    """vLLM's validate_legal: the largest of r and (0.32.0 on) every rank_pattern rank."""
    ranks = [("r", config.r)] if config.r is not None else []
    ranks += [(f"rank_pattern[{shown(k)}]", v) for k, v in config.rank_pattern.items()]
    for key, rank in ranks:
        if rank > max_rank:
            said = Reason.of(
                Code.ADAPTER_CONFIG_ABOVE_MAX_RANK, key=key, rank=rank, max_rank=max_rank
            )
            report.add(Kind.RANK_LIMIT, ADAPTER_CONFIG, key, said)


def _check_scale(report: Report, r: int, alpha: float, rslora: bool, pattern: str | None) -> None:
    """lora_alpha's scale (``pattern``: the alpha_pattern key whose alpha it is, or None)."""
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    low, high = SCALE_RANGE
    if not low <= scale <= high:
        said = Reason.of(
            Code.ADAPTER_SCALE_OUT_OF_RANGE,
            pattern=pattern,
            alpha=alpha,
            r=r,
            rslora=rslora,
            scale=scale,
        )
        report.add(Kind.SCALING, ADAPTER_CONFIG, "lora_alpha", said)


# ----- the weights file -----


def _open_weights(folder: Directory, report: Report) -> SafetensorsFile | None:
    if not folder.has(ADAPTER_SAFETENSORS):
        pickled = [name for name in PICKLES if folder.has(name)]
        if pickled:
            report.add(Kind.FILE, pickled[0], "", Reason.of(Code.ADAPTER_PICKLE))
        else:
            report.add(Kind.FILE, ADAPTER_SAFETENSORS, "", Reason.of(Code.ADAPTER_NO_WEIGHTS))
        return None
    path = folder.path / ADAPTER_SAFETENSORS
    try:
        return SafetensorsFile(path, opener=lambda: folder.open(ADAPTER_SAFETENSORS))
    except PatchkitError as exc:
        report.add(Kind.FILE, ADAPTER_SAFETENSORS, "", _unreadable(exc, path))
        return None


def _read_tensors(st: SafetensorsFile, adapter: _Adapter, report: Report) -> None:
    """Each tensor: scanned for NaN/Inf and filed under its module, or named as no factor."""
    file = ADAPTER_SAFETENSORS
    report.tensors = len(st.tensors)
    for key, info in st.tensors.items():
        if info.dtype not in nonfinite.FLOATS:
            report.add(Kind.NAME, file, key, _not_scanned(info.dtype))
        elif not info.numel:  # floating point, but (0, 2**63) holds nothing to scan
            said = Reason.of(Code.ADAPTER_EMPTY, dtype=info.dtype, shape=list(info.shape))
            report.add(Kind.SHAPE, file, key, said)
        else:
            try:
                bad, zero = nonfinite.scan_values(st, info)
            except PatchkitError as exc:  # cut short since its header was read
                report.add(Kind.FILE, file, key, _unreadable(exc, st.path))
                return
            report.bytes_scanned += info.nbytes
            if zero:
                adapter.zero.add(key)
            if bad is not None:
                report.add(Kind.NONFINITE, file, key, _bad_values(bad, info))
        _file_factor(key, info, adapter, report)


def _unreadable(exc: PatchkitError, path: Path) -> Reason:
    """The weights file cannot be read: the reader's error, said about the file the finding
    names (:func:`patchkit.adapters.directory.about`)."""
    return Reason.of(Code.ADAPTER_UNREADABLE, error=about(exc, path))


def _not_scanned(dtype: str) -> Reason:
    """Why a tensor of this dtype is refused: no float, or one patchkit cannot scan."""
    if dtype in ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"):
        return Reason.of(Code.ADAPTER_NOT_FLOAT, dtype=dtype)
    return Reason.of(Code.ADAPTER_NOT_SCANNED, dtype=dtype, scanned=list(nonfinite.FLOATS))


def _bad_values(bad: nonfinite.Nonfinite, info: TensorInfo) -> Reason:
    return Reason.of(
        Code.ADAPTER_NONFINITE_VALUES,
        count=bad.count,
        values=info.numel,
        nan=bad.nan,
        inf=bad.inf,
        beyond=bad.beyond,
        largest=nonfinite.BF16_LARGEST,
        first=bad.first,
        first_value=bad.first_value,
        dtype=info.dtype,
        shape=list(info.shape),
    )


def _file_factor(key: str, info: TensorInfo, adapter: _Adapter, report: Report) -> None:
    name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
    if name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
        report.notes.append(Reason.of(Code.ADAPTER_EMBEDDING_COPY, tensor=key))
        return
    match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
    embedding = False
    if match is None:
        match = re.fullmatch(r"(.+)\.lora_embedding_([AB])", name)
        embedding = True
    if match is None:
        report.add(Kind.NAME, ADAPTER_SAFETENSORS, key, Reason.of(Code.ADAPTER_NOT_FACTOR))
        return
    factors = adapter.modules.setdefault(match[1], Factors(match[1], embedding))
    if match[2] == "A":
        factors.a = info
    else:
        factors.b = info


def _check_pairs(adapter: _Adapter, report: Report, max_rank: int | None) -> None:
    """A with B, their ranks, their rank against r and --max-lora-rank (no model needed)."""
    file = ADAPTER_SAFETENSORS
    for module, f in adapter.modules.items():
        if f.a is None or f.b is None:
            have, lack = ("A", "B") if f.b is None else ("B", "A")
            said = Reason.of(Code.ADAPTER_UNPAIRED, have=have, lack=lack)
            report.add(Kind.NAME, file, (f.a or f.b).name, said)
            continue
        if len(f.a.shape) != 2 or len(f.b.shape) != 2:
            said = Reason.of(Code.ADAPTER_NOT_MATRICES, a=list(f.a.shape), b=list(f.b.shape))
            report.add(Kind.SHAPE, file, f.a.name, said)
            continue
        if f.a.shape[0] != f.b.shape[1]:
            transposed = f.a.shape[1] == f.b.shape[0]
            code = Code.ADAPTER_TRANSPOSED if transposed else Code.ADAPTER_RANKS_DIFFER
            said = Reason.of(code, a=list(f.a.shape), b=list(f.b.shape))
            report.add(Kind.LAYOUT if transposed else Kind.RANK, file, f.a.name, said)
            continue
        if _is_experts(module):
            continue  # rank = rows / experts: judged with the model
        _judge_rank(report, adapter, f, f.a.shape[0], max_rank)


def _check_effect(adapter: _Adapter, report: Report) -> None:
    """Modules whose lora_A or lora_B is all zero add nothing (B @ A = 0): every module so is
    an adapter that changes nothing (PEFT initialises lora_B to zero, so one saved before
    its first training step is one), a finding; some modules so, a note."""
    pairs = [f for f in adapter.modules.values() if f.a is not None and f.b is not None]
    inert = [f for f in pairs if f.a.name in adapter.zero or f.b.name in adapter.zero]
    if not inert:
        return
    which = "lora_B" if all(f.b.name in adapter.zero for f in inert) else "lora_A or lora_B"
    if len(inert) == len(pairs):
        said = Reason.of(Code.ADAPTER_ZERO_FACTORS, factors=which, modules=len(pairs))
        tensor = inert[0].b.name if which == "lora_B" else inert[0].a.name
        report.add(Kind.EFFECT, ADAPTER_SAFETENSORS, tensor, said)
        return
    said = Reason.of(
        Code.ADAPTER_ZERO_MODULES,
        zero=len(inert),
        modules=len(pairs),
        factors=which,
        example=inert[0].module,
    )
    report.notes.append(said)


def _judge_rank(
    report: Report, adapter: _Adapter, f: Factors, rank: int, max_rank, name: str | None = None
) -> None:
    """The factors' rank against the one PEFT and vLLM give the module ``name`` (the module's
    own by default; an expert parameter's for fused experts): rank_pattern's first matching
    key, else r."""
    config = adapter.config
    want, key = config.r, None
    try:
        found = config.matching("rank_pattern", name or f.module)
    except adapterconfig.PatternRefused as exc:  # its matching ran past the work bound
        adapter.key_refused(exc, report)
        found, want = None, None
    if found is not None:
        want, key = found[1], found[0]
    if want is not None and rank != want:
        said = Reason.of(
            Code.ADAPTER_RANK_NOT_CONFIG,
            rank=rank,
            want=want,
            pattern=key,
            unmatched=bool(found is None and config.rank_pattern),
        )
        report.add(Kind.RANK, ADAPTER_SAFETENSORS, f.a.name, said)
    if max_rank is not None and rank > max_rank and rank not in adapter.config.ranks:
        said = Reason.of(Code.ADAPTER_ABOVE_MAX_RANK, rank=rank, max_rank=max_rank)
        report.add(Kind.RANK_LIMIT, ADAPTER_SAFETENSORS, f.a.name, said)


def _is_experts(module: str) -> bool:
    return bool(re.search(r"\.experts(\.base_layer)*$", module))


# ----- against the model -----


def _model(model_dir: Path, report: Report) -> tuple[ModelShapes | None, str]:
    """The model's shapes (None for an architecture patchkit has no widths for) and its
    architecture, from one read of its config.json."""
    where = str(model_dir / "config.json")
    try:
        with Directory(model_dir) as folder:
            config = folder.read_json("config.json", "a model config")
        shapes = model_shapes(config, where)
    except PatchkitError as exc:
        raise exc.reworded(f"--model: {exc}", option="--model") from None
    arch = architecture(config)
    if shapes is None:
        named = _named(arch) if arch else None
        report.skipped.append(Reason.of(Code.ADAPTER_SKIPPED_UNKNOWN_MODEL, architecture=named))
    return shapes, arch


def _named(value: object, width: int = 60) -> str:
    """A name from the model's config.json as it is (escaped on output), or shown cut when it
    is no short string."""
    return value if isinstance(value, str) and len(value) <= width else shown(value, width)


def _check_model(adapter: _Adapter, shapes: ModelShapes, report: Report) -> None:
    other = []
    experts: dict[int, dict[str, Factors]] = {}
    for module, f in adapter.modules.items():
        if f.a is None or f.b is None or len(f.a.shape) != 2 or len(f.b.shape) != 2:
            continue
        place = layer_and_name(module)
        if place is None:
            other.append(module)
            continue
        layer, name = place
        if layer is None:
            _check_embedding(f, name, shapes, report)
        elif layer == NO_INDEX or layer >= shapes.layers:
            said = Reason.of(
                Code.ADAPTER_NO_SUCH_LAYER,
                layer=None if layer == NO_INDEX else layer,
                layers=shapes.layers,
            )
            report.add(Kind.TARGET, ADAPTER_SAFETENSORS, f.a.name, said)
        elif re.fullmatch(r"mlp\.experts(\.base_layer)*", name):
            experts.setdefault(layer, {})[name] = f
        else:
            _check_linear(f, layer, name, shapes, report)
    for layer, found in experts.items():
        _check_experts(adapter, layer, found, shapes, report)
    if other:
        said = Reason.of(Code.ADAPTER_OUTSIDE_LAYERS, modules=len(other), example=other[0])
        report.notes.append(said)
    _check_targets(adapter, shapes, report)


def _other_layout(adapter: _Adapter, arch: str, report: Report) -> None:
    """Without --target, whether the release maps the adapter's names is unknown; that they
    are laid out unlike the model's checkpoint (the text-only model's ``model.layers.N``
    for a multimodal ``model.language_model.layers.N``: vLLM #34186) is said as a note."""
    want = reach.HF_LANGUAGE_MODEL.get(arch)
    found = {m.split("layers.", 1)[0] for m in adapter.modules if ".layers." in f".{m}"}
    other = sorted(p for p in found if want is not None and p != want)
    if other:
        said = Reason.of(Code.ADAPTER_OTHER_LAYOUT, prefix=other[0], architecture=arch, want=want)
        report.notes.append(said)


def _check_embedding(f: Factors, name: str, shapes: ModelShapes, report: Report) -> None:
    """embed_tokens' lora_embedding_A (r, vocab) and _B (hidden, r); lm_head's lora_A
    (r, hidden) and lora_B (vocab, r)."""
    a, b = f.a.shape, f.b.shape
    if f.embedding:
        ok = a[1] == shapes.vocab and b[0] == shapes.hidden
    else:
        ok = a[1] == shapes.hidden and b[0] == shapes.vocab
    if not ok:
        said = Reason.of(
            Code.ADAPTER_EMBEDDING_MISFIT,
            module=name,
            a=list(a),
            b=list(b),
            embedding=f.embedding,
            vocab=shapes.vocab,
            hidden=shapes.hidden,
        )
        report.add(Kind.SHAPE, ADAPTER_SAFETENSORS, f.a.name, said)


def _check_linear(f: Factors, layer: int, name: str, shapes: ModelShapes, report: Report) -> None:
    per_expert = re.fullmatch(r"mlp\.experts\.([0-9]+)\.(gate_proj|up_proj|down_proj)", name)
    if per_expert and shapes.moe:
        expert = index(per_expert[1])
        if expert == NO_INDEX or expert >= shapes.experts:
            said = Reason.of(
                Code.ADAPTER_NO_SUCH_EXPERT,
                expert=None if expert == NO_INDEX else expert,
                experts=shapes.experts,
            )
            report.add(Kind.TARGET, ADAPTER_SAFETENSORS, f.a.name, said)
            return
        want = shapes.expert_proj[per_expert[2]]
    else:
        modules = shapes.layer_modules(layer)
        if name not in modules:
            said = Reason.of(
                Code.ADAPTER_NO_SUCH_MODULE,
                module=name,
                layer=layer,
                layer_type=_named(shapes.layer_types[layer]),
                moe=shapes.moe,
                architecture=shapes.architecture,
            )
            report.add(Kind.TARGET, ADAPTER_SAFETENSORS, f.a.name, said)
            return
        want = modules[name]
    _fit(f, want, f"layers.{layer}.{name}", report)


def _fit(f: Factors, want: tuple[int, int], where: str, report: Report) -> None:
    out, inp = want
    a, b = f.a.shape, f.b.shape
    if a[1] == inp and b[0] == out:
        return
    transposed = a[1] == out and b[0] == inp
    code = Code.ADAPTER_SWAPPED_IN_OUT if transposed else Code.ADAPTER_MISFIT
    said = Reason.of(code, a=list(a), b=list(b), module=where, out=out, inp=inp)
    report.add(Kind.LAYOUT if transposed else Kind.SHAPE, ADAPTER_SAFETENSORS, f.a.name, said)


def expert_params(adapter_params: list[str], found: dict) -> dict[str, str]:
    """Which expert parameter each experts module trains, PEFT's nesting: with two target
    parameters ``experts.base_layer`` is gate_up_proj and ``experts`` down_proj; with one,
    ``experts`` is that one ("" when the config does not say: judged by shape)."""
    named = [p for p in EXPERT_PARAMS if any(_names_param(t, p) for t in adapter_params)]
    if "mlp.experts.base_layer" in found:
        return {"mlp.experts.base_layer": "gate_up_proj", "mlp.experts": "down_proj"}
    return {"mlp.experts": named[0] if len(named) == 1 else ""}


def _names_param(name: str, param: str) -> bool:
    """PEFT's match of a target_parameters entry: the parameter's full name or a suffix of it
    at a dot (``gate_up_proj``, ``experts.gate_up_proj``, ``model...mlp.experts.gate_up_proj``)."""
    return name == param or name.endswith("experts." + param)


def _check_experts(adapter, layer: int, found: dict, shapes: ModelShapes, report) -> None:
    file = ADAPTER_SAFETENSORS
    if not shapes.moe:
        for f in found.values():
            report.add(Kind.TARGET, file, f.a.name, Reason.of(Code.ADAPTER_NO_EXPERTS))
        return
    params = expert_params(adapter.config.target_parameters, found)
    for name, f in found.items():
        if name not in params:
            report.add(Kind.LAYOUT, file, f.a.name, Reason.of(Code.ADAPTER_NESTED_TOO_DEEP))
            continue
        a, b = f.a.shape, f.b.shape
        n = shapes.experts
        if a[0] % n:
            said = Reason.of(Code.ADAPTER_EXPERT_ROWS, a=list(a), experts=n)
            report.add(Kind.SHAPE, file, f.a.name, said)
            continue
        fits, legacy = [], []
        for param in [params[name]] if params[name] else EXPERT_PARAMS:
            _, d1, d2 = shapes.expert_params[param]
            if a[1] == d2 and b[0] == d1:
                fits.append(param)
            elif a[1] == d1 and b[0] == d2:
                legacy.append(param)
        where = f"layers.{layer}.mlp.experts"
        if fits:
            if not params[name]:
                said = Reason.of(Code.ADAPTER_EXPERT_BY_SHAPE, module=where, parameter=fits[0])
                report.notes.append(said)
            root = re.sub(r"(\.base_layer)+$", "", f.module)
            _judge_rank(report, adapter, f, a[0] // n, None, f"{root}.{fits[0]}")
            continue
        wanted = [params[name]] if params[name] else list(EXPERT_PARAMS)
        said = Reason.of(
            Code.ADAPTER_EXPERTS_LEGACY if legacy else Code.ADAPTER_EXPERTS_MISFIT,
            a=list(a),
            b=list(b),
            module=where,
            experts=n,
            parameters=wanted,
            shapes=[list(shapes.expert_params[p]) for p in wanted],
        )
        report.add(Kind.LAYOUT if legacy else Kind.SHAPE, file, f.a.name, said)


def _check_targets(adapter: _Adapter, shapes: ModelShapes, report: Report) -> None:
    """target_modules and target_parameters the model has no module or parameter for."""
    targets = adapter.config.target_modules  # None, a pattern string, or a list of names
    held = {m.rsplit(".", 1)[-1] for m in adapter.modules}
    if isinstance(targets, list):
        for name in targets:
            last = name.rsplit(".", 1)[-1]
            if last not in shapes.module_names() and last not in held:
                arch = shapes.architecture
                said = Reason.of(Code.ADAPTER_NO_TARGET_MODULE, name=shown(name), architecture=arch)
                report.add(Kind.TARGET, ADAPTER_CONFIG, "target_modules", said)
    for name in adapter.config.target_parameters:
        param = name.rsplit(".", 1)[-1]
        if not any(_names_param(name, p) for p in EXPERT_PARAMS) or not shapes.moe:
            said = Reason.of(
                Code.ADAPTER_NO_TARGET_PARAMETER, name=shown(name), parameter=shown(param, 40)
            )
            report.add(Kind.TARGET, ADAPTER_CONFIG, "target_parameters", said)
