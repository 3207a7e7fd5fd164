"""`adapter check --target`: what one installed vLLM release would refuse or ignore.

Four things, each read from the tree, not from its version number alone:

- an adapter on one expert parameter (``<experts>.lora_A`` with no
  ``<experts>.base_layer``): every release from 0.17.0 stops at ``assert
  gate_up_proj_lora is not None`` in ``_stack_moe_lora_weights`` unless
  ``partial-moe-adapter`` is applied. The catalogue's notice for that patch
  holds exactly when its evidence (that assert) is in the tree's
  model_manager.py and the patch is not applied, so the notice is the test;
- a GDN layer adapted in only one of in_proj_qkv / in_proj_z: from 0.21.0
  vLLM packs them into in_proj_qkvz and ``expand_packed_lora`` crashes on
  the missing member (0.21-0.28 both ways; 0.29+ only when in_proj_qkv is
  the missing one), unless ``partial-gdn-adapter`` is applied; again the
  patch's notices decide;
- modules the release's LoRA loader refuses by name
  (:mod:`patchkit.adapters.release`);
- ``rank_pattern``/``alpha_pattern`` that the release never reads (its
  ``PEFTHelper`` has no such field before 0.32.0): a module they give
  another scale is served at the scale of r and lora_alpha.
"""

from __future__ import annotations

import ast
import math
import shlex

from packaging.version import Version

from patchkit.adapters import reach
from patchkit.adapters.adapterconfig import PatternRefused
from patchkit.adapters.names import ADAPTER_CONFIG, ADAPTER_SAFETENSORS, NO_INDEX, layer_and_name
from patchkit.adapters.registry import parse
from patchkit.adapters.release import LoraSupport, lora_support
from patchkit.adapters.report import Kind, Report
from patchkit.catalogue.load import load_catalogue
from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.patching import operations
from patchkit.patching.decide import apply_command
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import PatchState

MOE_PATCH = "partial-moe-adapter"
GDN_PATCH = "partial-gdn-adapter"
# From 0.29.0 (vLLM PR #47640) an in_proj_qkv-only layer loads; in_proj_z-only still raises.
GDN_QKV_ONLY_LOADS = Version("0.29.0")
PEFT_HELPER = "vllm/lora/peft_helper.py"


def check_release(adapter, shapes, arch: str, tree: VllmTree, report: Report) -> None:
    report.vllm_version = tree.version
    steps = operations.status(tree, load_catalogue()).steps
    assessments = {s.assessment.patch.id: s.assessment for s in steps}
    fix = _fixes(assessments, tree)
    _single_parameter_experts(adapter, tree, assessments.get(MOE_PATCH), fix, report)
    _partial_gdn(adapter, tree, assessments.get(GDN_PATCH), fix, report)
    support = _support(arch, tree, report)
    if support is not None:
        _unwrapped(adapter, arch, support, tree, report)
        _reach(adapter, arch, support, tree, report)
    _patterns_unread(adapter, tree, report)


def _fixes(assessments: dict, tree: VllmTree) -> dict[str, str]:
    """Per patch, the command that applies it on this tree: `patchkit apply`, or `apply
    --only ID` where a plain apply would refuse (status's rule), with the tree named."""
    states = {i: a.state for i, a in assessments.items()}
    opt_in = {i for i, a in assessments.items() if a.patch.opt_in}
    target = f" --target {shlex.quote(str(tree.root))}"
    return {i: apply_command(states, opt_in, i) + target for i in assessments}


def _say(report: Report, notice, tensor: str, message: str, tree: VllmTree) -> None:
    """A finding where the catalogue decided this release; a note where it has not (the
    bug was seen up to an older release: unknown here, never asserted)."""
    if notice.undecided:
        report.notes.append(
            f"{tensor}: unknown on vLLM {tree.version}, which this catalogue has not decided "
            f"(seen up to {notice.seen_up_to}, and the code it was seen in is still there): "
            f"{message}"
        )
    else:
        report.add(Kind.RELEASE, ADAPTER_SAFETENSORS, tensor, message)


def _by_layer(adapter) -> dict[int, dict[str, object]]:
    layers: dict[int, dict[str, object]] = {}
    for module, f in adapter.modules.items():
        place = layer_and_name(module)
        if place is not None and place[0] is not None and place[0] != NO_INDEX:
            layers.setdefault(place[0], {})[place[1]] = f
    return layers


def _first_factor(f) -> str:
    return (f.a or f.b).name


def _single_parameter_experts(adapter, tree: VllmTree, assessment, fix, report: Report) -> None:
    notices = assessment.notices if assessment else []
    if not notices:
        return  # the patch is applied, or the release does not have the assert
    for layer, names in sorted(_by_layer(adapter).items()):
        if "mlp.experts" in names and "mlp.experts.base_layer" not in names:
            _say(
                report,
                notices[0],
                _first_factor(names["mlp.experts"]),
                f"layer {layer}: an adapter on one expert parameter; vLLM {tree.version} stops "
                f"at `assert gate_up_proj_lora is not None` (_stack_moe_lora_weights) unless "
                f"{MOE_PATCH} is applied{_how(assessment, fix)}",
                tree,
            )


def _how(assessment, fix: dict[str, str]) -> str:
    """`` (`COMMAND`)`` that applies the patch here, or why patchkit cannot."""
    if assessment.state == PatchState.NEEDED:
        return f" (`{fix[assessment.patch.id]}`)"
    return f" (it is {assessment.state} here: `patchkit status` says why)"


def _partial_gdn(adapter, tree: VllmTree, assessment, fix, report: Report) -> None:
    notices = assessment.notices if assessment else []
    if not notices:
        return  # applied, not applicable (0.17-0.20: separate modules), or fixed upstream
    version = tree.parsed_version
    for layer, names in sorted(_by_layer(adapter).items()):
        qkv, z = "linear_attn.in_proj_qkv" in names, "linear_attn.in_proj_z" in names
        if qkv == z:
            continue
        if qkv and version is not None and version >= GDN_QKV_ONLY_LOADS:
            continue
        have, lack = ("in_proj_qkv", "in_proj_z") if qkv else ("in_proj_z", "in_proj_qkv")
        _say(
            report,
            notices[0],
            _first_factor(names[f"linear_attn.{have}"]),
            f"layer {layer}: {have} without {lack}; vLLM {tree.version} packs them as "
            f"in_proj_qkvz and expand_packed_lora fails on the missing one unless {GDN_PATCH} "
            f"is applied{_how(assessment, fix)}",
            tree,
        )


def _support(arch: str, tree: VllmTree, report: Report) -> LoraSupport | None:
    """The release's LoRA names for the architecture, or None with the check said skipped."""
    try:
        support = lora_support(tree, arch) if arch else None
        name = arch if len(arch) <= 60 else arch[:57] + "..."  # config.json's, any length
        why = f"architecture {name}" if arch else "no --model to name the architecture"
    except PatchkitError as exc:
        support, why = None, str(exc)
    if support is None:
        report.skipped.append(
            f"modules vLLM {tree.version}'s LoRA code wraps ({why}; patchkit reads "
            "the Qwen3.5/3.6 and Qwen3-Next model files)"
        )
    return support


def _unwrapped(adapter, arch: str, support: LoraSupport, tree: VllmTree, report: Report) -> None:
    for module, f in sorted(adapter.modules.items()):
        if "base_layer" in module:  # vLLM's check skips these names
            continue
        if support.refuses(module):
            per_expert = ".experts." in module and module.split(".experts.")[1][:1].isdigit()
            hint = (
                " (a per-expert adapter on a 3D-expert model: re-save it with PEFT "
                "target_parameters, or serve with --enable-mixed-moe-lora-format where the "
                "release has it)"
                if per_expert and support.is_3d
                else ""
            )
            report.add(
                Kind.RELEASE,
                ADAPTER_SAFETENSORS,
                _first_factor(f),
                f"vLLM {tree.version} refuses the adapter: its LoRA code wraps no module "
                f"named like {module} for {arch}{hint}",
            )


def _reach(adapter, arch: str, support: LoraSupport, tree: VllmTree, report: Report) -> None:
    """Per module whether the release wraps it (report.targets); findings for what it
    refuses that :func:`_unwrapped` does not say, for modules it would ignore, and for an
    adapter it would serve as the base model."""
    try:
        lay = reach.layout(tree, support, arch)
    except PatchkitError as exc:
        report.skipped.append(f"which modules vLLM {tree.version} reaches ({exc})")
        return
    rows = [reach.reach(module, lay, support) for module in sorted(adapter.modules)]
    report.targets = [
        {"module": r.module, "vllm_module": r.vllm_module, "outcome": r.outcome, "why": r.why}
        for r in rows
    ]
    factor = {m: _first_factor(f) for m, f in adapter.modules.items()}
    for r in rows:
        if r.outcome == "refused" and not support.refuses(r.module.removesuffix(".base_layer")):
            report.add(
                Kind.RELEASE,
                ADAPTER_SAFETENSORS,
                factor[r.module],
                f"vLLM {tree.version} refuses the adapter: {r.module}: {r.why}",
            )
    tower = [r for r in rows if r.outcome == "ignored" and r.why.startswith("the vision tower")]
    ignored = [r for r in rows if r.outcome == "ignored" and r not in tower]
    wrapped = [r for r in rows if r.outcome == "wrapped"]
    if tower:
        report.notes.append(
            f"{len(tower)} module(s) in the vision tower (e.g. {tower[0].module}): {tower[0].why}; "
            "text prompts never reach them"
        )
    if not ignored:
        return
    example = f"e.g. {ignored[0].module} -> {ignored[0].vllm_module}: {ignored[0].why}"
    if not wrapped and len(ignored) == len(rows) - len(tower):
        report.add(
            Kind.RELEASE,
            ADAPTER_SAFETENSORS,
            factor[ignored[0].module],
            f"vLLM {tree.version} would serve this adapter as the base model: none of its "
            f"{len(rows)} modules reaches a module its LoRA code wraps ({example}); "
            "it loads without a warning",
            Code.ADAPTER_SERVED_AS_BASE,
        )
        return
    report.add(
        Kind.RELEASE,
        ADAPTER_SAFETENSORS,
        factor[ignored[0].module],
        f"vLLM {tree.version} ignores {len(ignored)} of the adapter's {len(rows)} modules: "
        f"their weights reach no module its LoRA code wraps, so they serve as the base model "
        f"({example})",
        Code.ADAPTER_MODULES_IGNORED,
    )


def _patterns_unread(adapter, tree: VllmTree, report: Report) -> None:
    """rank_pattern / alpha_pattern on a release whose PEFTHelper has no such field (every
    release before 0.32.0): from_dict drops them unread and serves every module at the
    scale of r and lora_alpha. A finding when that scale is not PEFT's for some module."""
    config = adapter.config
    used = [k for k in ("rank_pattern", "alpha_pattern") if getattr(config, k)]
    if not used or config.r is None or config.alpha is None:
        return
    try:
        fields = _peft_helper_fields(tree)
    except PatchkitError as exc:
        report.skipped.append(f"whether vLLM {tree.version} reads {' and '.join(used)} ({exc})")
        return
    unread = [k for k in used if k not in fields]
    if not unread:
        return
    served = config.scale(config.r, config.alpha)
    changed = []
    for module in sorted(adapter.modules):
        try:
            rank, alpha = config.rank_alpha(_pattern_name(module))
        except PatternRefused as exc:  # a key matched past its work bound
            adapter.key_refused(exc, report)
            return
        if not math.isclose(config.scale(rank, alpha), served, rel_tol=1e-9):
            changed.append(module)
    if changed:
        report.add(
            Kind.RELEASE,
            ADAPTER_CONFIG,
            unread[0],
            f"vLLM {tree.version} does not read {' or '.join(unread)} (its PEFTHelper has no "
            f"such field; 0.32.0 on reads them): it serves {len(changed)} module(s) (e.g. "
            f"{changed[0]}) at the scale of r and lora_alpha, not the one PEFT trained",
        )


def _pattern_name(module: str) -> str:
    """The name vLLM (0.32.0 on) and PEFT match patterns against: the fused experts as their
    parameters, ``experts.base_layer`` gate_up_proj and ``experts`` down_proj."""
    if module.endswith(".experts.base_layer"):
        return module.removesuffix(".base_layer") + ".gate_up_proj"
    if module.endswith(".experts"):
        return module + ".down_proj"
    return module


def _peft_helper_fields(tree: VllmTree) -> set[str]:
    """The fields of the release's PEFTHelper dataclass (``name: type = ...`` in its body)."""
    parsed = parse(tree, PEFT_HELPER, "vLLM's reader of adapter_config.json")
    if parsed is None:
        raise PatchkitError(f"{tree.root / PEFT_HELPER} is missing")
    for node in parsed.body:
        if isinstance(node, ast.ClassDef) and node.name == "PEFTHelper":
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise PatchkitError(f"{tree.root / PEFT_HELPER}: defines no class PEFTHelper")
