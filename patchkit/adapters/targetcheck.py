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
from patchkit.adapters.registry import NotUnderstood, parse
from patchkit.adapters.release import LoraSupport, lora_support
from patchkit.adapters.report import Kind, Report
from patchkit.catalogue.load import load_catalogue
from patchkit.codes import Code, Reason
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


def _say(report: Report, notice, tensor: str, message: Reason, tree: VllmTree) -> None:
    """A finding where the catalogue decided this release; a note where it has not (the
    bug was seen up to an older release: unknown here, never asserted)."""
    if notice.undecided:
        said = Reason.of(
            Code.ADAPTER_RELEASE_UNDECIDED,
            tensor=tensor,
            version=tree.version,
            seen_up_to=notice.seen_up_to,
            finding=message,
        )
        report.notes.append(said)
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
            said = Reason.of(
                Code.ADAPTER_ONE_EXPERT_PARAMETER,
                layer=layer,
                version=tree.version,
                **_how(assessment, fix),
            )
            _say(report, notices[0], _first_factor(names["mlp.experts"]), said, tree)


def _how(assessment, fix: dict[str, str]) -> dict:
    """The facts of how the patch gets applied here: ``patch``, its ``state`` and the
    ``command`` that applies it (None where patchkit cannot: `patchkit status` says why)."""
    needed = assessment.state == PatchState.NEEDED
    return {
        "patch": assessment.patch.id,
        "state": str(assessment.state),
        "command": fix[assessment.patch.id] if needed else None,
    }


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
        said = Reason.of(
            Code.ADAPTER_PARTIAL_GDN,
            layer=layer,
            have=have,
            lack=lack,
            version=tree.version,
            **_how(assessment, fix),
        )
        _say(report, notices[0], _first_factor(names[f"linear_attn.{have}"]), said, tree)


def _support(arch: str, tree: VllmTree, report: Report) -> LoraSupport | None:
    """The release's LoRA names for the architecture, or None with the check said skipped."""
    name = arch if len(arch) <= 60 else arch[:57] + "..."  # config.json's, any length
    try:
        support, error = (lora_support(tree, arch) if arch else None), None
    except PatchkitError as exc:
        support, error = None, str(exc)
    if support is None:
        said = Reason.of(
            Code.ADAPTER_SKIPPED_LORA_MODULES,
            version=tree.version,
            architecture=name or None,
            error=error,
        )
        report.skipped.append(said)
    return support


def _unwrapped(adapter, arch: str, support: LoraSupport, tree: VllmTree, report: Report) -> None:
    for module, f in sorted(adapter.modules.items()):
        if "base_layer" in module:  # vLLM's check skips these names
            continue
        if support.refuses(module):
            per_expert = ".experts." in module and module.split(".experts.")[1][:1].isdigit()
            said = Reason.of(
                Code.ADAPTER_NOT_WRAPPED,
                version=tree.version,
                module=module,
                architecture=arch,
                per_expert_on_3d=per_expert and support.is_3d,
            )
            report.add(Kind.RELEASE, ADAPTER_SAFETENSORS, _first_factor(f), said)


def _reach(adapter, arch: str, support: LoraSupport, tree: VllmTree, report: Report) -> None:
    """Per module whether the release wraps it (report.targets); findings for what it
    refuses that :func:`_unwrapped` does not say, for modules it would ignore, and for an
    adapter it would serve as the base model."""
    try:
        lay = reach.layout(tree, support, arch)
    except PatchkitError as exc:
        said = Reason.of(Code.ADAPTER_SKIPPED_REACH, version=tree.version, error=str(exc))
        report.skipped.append(said)
        return
    rows = [reach.reach(module, lay, support) for module in sorted(adapter.modules)]
    report.targets = [
        {"module": r.module, "vllm_module": r.vllm_module, "outcome": r.outcome, "why": r.why}
        for r in rows
    ]
    factor = {m: _first_factor(f) for m, f in adapter.modules.items()}
    for r in rows:
        if r.outcome == "refused" and not support.refuses(r.module.removesuffix(".base_layer")):
            said = Reason.of(
                Code.ADAPTER_REACH_REFUSED, version=tree.version, module=r.module, why=r.why
            )
            report.add(Kind.RELEASE, ADAPTER_SAFETENSORS, factor[r.module], said)
    tower = [r for r in rows if r.outcome == "ignored" and r.why.code == Code.REACH_VISION_TOWER]
    ignored = [r for r in rows if r.outcome == "ignored" and r not in tower]
    wrapped = [r for r in rows if r.outcome == "wrapped"]
    if tower:
        said = Reason.of(
            Code.ADAPTER_VISION_TOWER, modules=len(tower), example=tower[0].module, why=tower[0].why
        )
        report.notes.append(said)
    if not ignored:
        return
    first = ignored[0]
    served_as_base = not wrapped and len(ignored) == len(rows) - len(tower)
    said = Reason.of(
        Code.ADAPTER_SERVED_AS_BASE if served_as_base else Code.ADAPTER_MODULES_IGNORED,
        version=tree.version,
        ignored=len(ignored),
        modules=len(rows),
        example=first.module,
        vllm_module=first.vllm_module,
        why=first.why,
    )
    report.add(Kind.RELEASE, ADAPTER_SAFETENSORS, factor[first.module], said)


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
        said = Reason.of(
            Code.ADAPTER_SKIPPED_PATTERNS, version=tree.version, patterns=used, error=str(exc)
        )
        report.skipped.append(said)
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
        said = Reason.of(
            Code.ADAPTER_PATTERNS_UNREAD,
            version=tree.version,
            patterns=unread,
            modules=len(changed),
            example=changed[0],
        )
        report.add(Kind.RELEASE, ADAPTER_CONFIG, unread[0], said)


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
        raise NotUnderstood(f"{tree.root / PEFT_HELPER} is missing", path=tree.root / PEFT_HELPER)
    for node in parsed.body:
        if isinstance(node, ast.ClassDef) and node.name == "PEFTHelper":
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise NotUnderstood(
        f"{tree.root / PEFT_HELPER}: defines no class PEFTHelper", path=tree.root / PEFT_HELPER
    )
