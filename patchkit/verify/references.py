"""What each adapter of a `verify --model` run is judged against: the merged references
(planned, written, served by engines of their own), or transformers + PEFT, and how
precise each is (its floors)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.codes import Code, Reason
from patchkit.verify import checks, serving
from patchkit.verify.engines import ENGINE_TIMEOUT, PEFT_ENTRY, REFERENCES, Served
from patchkit.verify.rule import (
    MERGED_BOUNDS,
    MOE_LONE_TOKENS,
    PEFT_MOE_MAX_FLOOR,
    finite_answer,
)


def plan_references(model_dir: Path, adapters: dict[str, Path], workdir: Path, say) -> dict:
    """Plan every merge (headers only), say the disk they need, refuse when it is not free.

    Nothing is written before this returns, so a refusal leaves the disk as it was.
    """
    from patchkit.verify import mergeplan

    plans = {name: mergeplan.plan_merge(model_dir, path) for name, path in adapters.items()}
    needed = 2 * sum(plan.bytes_needed for plan in plans.values())  # reference and control
    free = shutil.disk_usage(_existing(workdir)).free
    say(
        f"merged references: {len(plans)} adapter(s), each merged twice (rounded to nearest, "
        f"and stochastically as the measure of the reference's own bf16 precision), need "
        f"{mergeplan.human_bytes(needed)} under {workdir} ({mergeplan.human_bytes(free)} free); "
        "removed afterwards unless --keep"
    )
    for plan in plans.values():
        for note in plan.notes:
            say(f"note: {note}")
    if needed > free:
        raise mergeplan.NotEnoughSpace(
            f"the merged references need {mergeplan.human_bytes(needed)} under {workdir} and "
            f"{mergeplan.human_bytes(free)} is free; give --workdir a disk with more space",
            path=workdir,
            needed=needed,
            free=free,
        )
    return plans


def _existing(path: Path) -> Path:
    """The nearest existing directory at or above path (where disk_usage can look)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def reference_paths(plans: dict, workdir: Path) -> dict[str, dict[str, Path]]:
    """Where write_references puts each adapter's merged checkpoint and rounding control
    (known before they are written, so their engines can be planned meanwhile)."""
    return {name: {kind: workdir / f"{kind}-{name}" for kind in REFERENCES} for name in plans}


def write_references(
    plans: dict, workdir: Path, say, seed: int, cancel=None, written=None
) -> dict[str, dict[str, Path]]:
    """Each merged checkpoint under workdir/merged-NAME, and its rounding control
    (the same merge rounded stochastically) under workdir/rounding-NAME. ``cancel`` (a
    threading.Event) stops it between tensors, the one being written removed;
    ``written(path)`` is called as each is complete."""
    from patchkit.verify import mergewrite

    out = reference_paths(plans, workdir)
    for number, (name, plan) in enumerate(plans.items()):
        say(f"writing merged reference and rounding control for {name}")
        mergewrite.write_merged(plan, out[name]["merged"], cancel=cancel)
        if written:
            written(out[name]["merged"])
        control_seed = (seed * 1000 + number) % (1 << 63)  # manual_seed takes < 2**64
        mergewrite.write_merged(
            plan, out[name]["rounding"], stochastic_seed=control_seed, cancel=cancel
        )
        if written:
            written(out[name]["rounding"])
    return out


@dataclass
class Reference:
    """What one adapter's LoRA answers are judged against, and how precise it is.

    ``floors`` is, per LoRA engine (mode) and prompt, the (mean, max) distance
    that says how far the reference itself is from what vLLM would answer if
    nothing were wrong: for the merged reference its two bf16 roundings
    (nearest vs stochastic), the same for every mode; for the PEFT reference
    |vLLM base - PEFT base| of that mode's engine (vLLM's own bf16 error
    against float32). ``base`` is the reference's answers without the
    adapter (None: vLLM's own base answers), for the adapter's effect.

    The merged reference's bound is ROUNDING_FACTOR (1.5) x its floor (bounds_for).
    The PEFT reference is judged by the excess (rule.Excess): the median per-token
    distance in units of ``noise``, the median |vLLM base - PEFT base| of the same
    engine and prompt; its floors still bound the worst token. The controls check on
    every run that the rule tells a wrong LoRA path apart instead of trusting it.
    """

    kind: str  # "merged" or "peft"
    runs: dict | None  # {prompt: request}; None when it did not run
    floors: dict[str, dict[str, tuple[float, float]]]
    why: Reason | None  # why this reference judges the adapter (None: not chosen yet)
    missing: str = ""  # why it did not run, when runs is None
    base: dict | None = None
    max_floor: float = MERGED_BOUNDS[1]  # the least max bound (PEFT_MOE_MAX_FLOOR on MoE)
    lone: int = 0  # tokens that may pass the max bound, up to the ceiling (PEFT on a MoE)
    # PEFT: per LoRA engine and prompt, the median |vLLM base - PEFT base| (rule.Excess's
    # noise: the PEFT reference is judged by the excess over it); {} for the merged one
    noise: dict[str, dict[str, float]] = field(default_factory=dict)
    # per engine and prompt, |vLLM base - PEFT base| per token: the noise of each stretch
    # of the prompt (rule.stretch_excess); {} for the merged one
    errors: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def merged_reference(run: Served, adapter: str, why: Reason | None) -> Reference:
    """The merged reference: floors from its rounding control, the same in every mode."""
    runs = _reference_runs(run, "merged", adapter)
    floors = rounding_floors(run, adapter)
    error = run.reference("merged", adapter).result.get("error", "")
    return Reference("merged", runs, {lora.engine.name: floors for lora in run.lora()},
                     why, missing=error or "it served nothing")  # fmt: skip


def peft_reference(run: Served, adapter: str, why: Reason | None) -> Reference:
    """The transformers + PEFT reference: floors from vLLM base vs PEFT base, per mode."""
    peft = run.peft or {"error": "not run"}
    runs = peft.get("runs", {})
    mine, base = runs.get(f"lora:{adapter}"), runs.get("base")
    if "error" in peft or not isinstance(mine, dict) or "error" in mine or not base:
        missing = peft.get("error") or (mine or {}).get("error") or "it served nothing"
        return Reference("peft", None, {}, why, missing=f"the PEFT reference: {missing}")
    floors, noise, errors = {}, {}, {}
    for lora in run.lora():
        vllm_base = lora.runs.get("base") or {}
        floors[lora.engine.name] = _floors(vllm_base, base, partial=True)
        mode = errors[lora.engine.name] = _base_errors(vllm_base, base)
        noise[lora.engine.name] = {prompt: statistics.median(e) for prompt, e in mode.items()}
    routed = any(lora.result.get("routed_experts", 0) for lora in run.lora())
    max_floor = PEFT_MOE_MAX_FLOOR if routed else MERGED_BOUNDS[1]
    return Reference("peft", mine, floors, why, base=base, max_floor=max_floor, noise=noise,
                     errors=errors, lone=MOE_LONE_TOKENS if routed else 0)  # fmt: skip


def _base_errors(ours: dict, theirs: dict) -> dict[str, list[float]]:
    """Per prompt of ``theirs``, |ours - theirs| per token (vLLM's own base error against
    the PEFT reference's base; its median is the prompt's noise); a prompt missing from
    either, of another length, or with a value that is not finite, is left out (no noise
    to judge it by: the median would hide that token)."""
    out = {}
    for prompt, request in theirs.items():
        mine, wanted = finite_answer(ours.get(prompt)), finite_answer(request)
        if mine is not None and wanted is not None and len(mine) == len(wanted):
            out[prompt] = [abs(x - y) for x, y in zip(mine, wanted, strict=True)]
    return out


def _floors(ours: dict, theirs: dict, partial: bool = False) -> dict[str, tuple[float, float]]:
    """Per prompt of ``theirs``, (mean, max) |ours - theirs|; {} when one is missing or
    a value is not finite (no precision can be read from it), or with ``partial`` that
    prompt left out (vLLM's error against PEFT: the prompt's rows are then unjudged, and
    the other prompts keep a bound of their own, not MERGED_BOUNDS)."""
    floors = {}
    for prompt, request in theirs.items():
        other = ours.get(prompt)
        floor = (float("inf"),)
        if isinstance(request, dict) and isinstance(other, dict):
            floor = checks.diff(other["prompt_logprobs"], request["prompt_logprobs"])
        if not all(math.isfinite(v) for v in floor):
            if partial:
                continue
            return {}
        floors[prompt] = floor
    return floors


def _reference_runs(run: Served, kind: str, adapter: str) -> dict | None:
    return run.reference(kind, adapter).runs.get("merged")


def rounding_floors(run: Served, adapter: str) -> dict[str, tuple[float, float]]:
    """Per prompt, (mean, max) |reference - rounding control|: the reference's own
    precision. {} when either did not run or a value is not finite."""
    merged = _reference_runs(run, "merged", adapter)
    control = _reference_runs(run, "rounding", adapter)
    if not merged or not control:
        return {}
    return _floors(control, merged)


def peft_or_merged(run: Served, name: str, merged: Reference) -> Reference:
    """The PEFT reference for an adapter the merged one could not decide; when PEFT did
    not run (no transformers, no peftref), the merged verdict stands and says why."""
    why = merged.why
    if merged.kind == "merged":
        why = Reason.of(Code.VERIFY_PEFT_DECIDES, because=merged.why)
    peft = peft_reference(run, name, why)
    if peft.runs is None and merged.kind == "merged":
        missing = Reason.of(Code.VERIFY_PEFT_DID_NOT_RUN, because=merged.why, missing=peft.missing)
        return dataclasses.replace(merged, why=missing)
    return peft


def run_peft_reference(
    model_dir: Path, adapters: dict[str, Path], prompts: dict, work: Path
) -> dict:
    """transformers + PEFT's answers (patchkit.verify.peftref in a child process), in a
    served engine's form, or ``{"error": ...}`` (the verdict then says why)."""
    try:
        from patchkit.verify import peftref
    except ImportError as exc:
        return {"error": f"patchkit.verify.peftref cannot be imported ({exc})"}
    job = peftref.job(model_dir, adapters, prompts, name=PEFT_ENTRY)  # every GPU: alone
    return serving.alone(job, work, ENGINE_TIMEOUT)


def reference_base(keep: Path | None, workdir: Path | None) -> Path:
    """The directory whose disk the merged references go on."""
    return keep if keep is not None else Path(workdir or tempfile.gettempdir())
