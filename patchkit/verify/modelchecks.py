"""The checks of one `verify --model` run: each reference healthy and precise enough,
each LoRA engine healthy, each adapter within its reference's bound, moving the output,
its controls rejected, and what `adapter check` found first."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from patchkit.verify import baserows, checks
from patchkit.verify.checks import Check
from patchkit.verify.engines import EngineServed, Served
from patchkit.verify.references import Reference, merged_reference, rounding_floors
from patchkit.verify.rule import (
    EFFECT_FLOOR,
    EFFECT_SHARE,
    FAIL_EXCESS,
    MERGED_BOUNDS,
    PASS_EXCESS,
    RESOLUTION_LIMIT,
    ROUNDING_FACTOR,
    ROUNDING_LIMIT,
    Measured,
    bounds_for,
    ceiling_for,
    decisive,
    extent,
    finite_answer,
    floor_text,
    mean_decisive,
    measure,
    unjudged,
)


def compare(
    served: dict,
    adapters: list[str],
    prefix: str = "",
    controls: dict[str, list] | None = None,
    references: dict[str, Reference] | None = None,
) -> list[Check]:
    """Every check of one `--model` run: the references, then each mode.

    ``served`` is served.json's form (serving.serve_all's, or a recorded run's),
    read here once into what each engine served. Each adapter is judged
    against ``references[adapter]`` (default: its merged reference) and
    its ``controls`` (patchkit.verify.adaptercontrols) must be rejected.
    """
    run = Served.from_json(served, adapters, prefix, merged=_any_merged(references))
    references = references or {a: merged_reference(run, a, None) for a in adapters}
    out = []
    for name in adapters:
        if references[name].kind == "merged":
            out += merged_reference_checks(f"{prefix}reference {name}", run, name)
    for lora in run.lora():
        out += compare_mode(lora, run, adapters, references, controls or {})
    lora_names = {e.engine.mode: e.engine.name for e in run.lora()}
    return out + baserows.base_rows_checks(served, lora_names, prefix)


def _any_merged(references: dict[str, Reference] | None) -> bool:
    return references is None or any(r.kind == "merged" for r in references.values())


def merged_reference_checks(label: str, run: Served, name: str) -> list[Check]:
    """The merged reference and its rounding control ran, healthy, and are precise
    enough to judge by; a problem here leaves the adapter undecided, not failed
    (the reference is the adapter merged into bf16 weights, not vLLM's LoRA path)."""
    result = run.reference("merged", name).result
    out = checks.engine_ran(f"{label} (merged, no LoRA)", result)
    if "error" not in result:
        out += checks.health_checks(f"{label} (merged, no LoRA)", result)
    out += rounding_check(label, run, name, rounding_floors(run, name))
    return [_undecided(c, name) for c in out]


def _undecided(check: Check, adapter: str) -> Check:
    return Check(check.name, check.ok, check.detail, adapter, decided=check.ok)


def compare_mode(
    lora: EngineServed, run: Served, adapters: list[str], references: dict, controls: dict
) -> list[Check]:
    """One LoRA engine: health, each adapter against its reference, the repeats."""
    name, result = lora.engine.name, lora.result
    ran = checks.engine_ran(name, result)
    if "error" in result:
        return ran
    runs = result["runs"]
    out = ran + checks.health_checks(name, result)
    for adapter in adapters:
        reference = references[adapter]
        floors = reference.floors.get(name, {})
        out += adapter_checks(name, adapter, runs, reference, floors, controls.get(adapter, []))
    out.append(
        checks.repeat_check(
            name, runs, "base_after_lora", "base", "base after LoRA equals base before"
        )
    )
    out.append(
        checks.repeat_check(
            name,
            runs,
            "lora_after_long",
            f"lora:{adapters[0]}",
            "short prompt after a long one unaffected",
        )
    )
    return out


def rounding_check(
    label: str, run: Served, adapter: str, floors: dict[str, tuple[float, float]]
) -> list[Check]:
    """The rounding control ran, and the reference is precise enough to judge LoRA by
    (``floors``: rounding_floors of this adapter)."""
    control = run.reference("rounding", adapter).result
    ran = checks.engine_ran(f"{label} (rounding control)", control)
    if "error" in control or "error" in run.reference("merged", adapter).result:
        return ran
    title = f"{label}: its own bf16 rounding"
    if not floors:
        why = (
            "no finite distance between the two references: NaN or inf in their answers "
            "(the merged weights hold them), or a prompt missing from one of them"
        )
        return [*ran, Check(title, False, why)]
    means = [f[0] for f in floors.values()]
    detail = (
        f"mean |nearest - stochastic| {min(means):.4f}-{max(means):.4f} (<= {ROUNDING_LIMIT}), "
        f"max {max(f[1] for f in floors.values()):.3f}; LoRA allowed {ROUNDING_FACTOR}x that"
    )
    if max(means) > ROUNDING_LIMIT:
        detail += ": the reference is too coarse in bf16 to judge a LoRA path by"
    return [*ran, Check(title, max(means) <= ROUNDING_LIMIT, detail)]


def adapter_checks(
    name: str,
    adapter: str,
    runs: dict,
    reference: Reference | dict | None,
    floors: dict | None = None,
    controls: list | None = None,
) -> list[Check]:
    """The adapter loaded, answers finite, matches its reference within the reference's
    own precision (``floors``, per prompt, taken together by bounds_for), changes the
    output, and each control falls outside the bound. ``reference`` may be the merged
    reference's answers alone ({prompt: request}), as recorded runs hold them."""
    if not isinstance(reference, Reference):
        reference = Reference("merged", reference, {name: floors or {}}, None)
    label = f"lora:{adapter}"
    error = checks.served_error(runs, label)
    if error:
        return [Check(f"{name}: {adapter} adapter served", False, error, adapter)]
    health = checks.rows_check(f"{name}: {adapter} answers", runs, [label])
    if not health.ok:
        return [Check(health.name, False, health.detail, adapter)]
    against = f"vs {reference.kind}"
    if not reference.runs:
        why = f"the reference did not run: {reference.missing}"
        return [Check(f"{name}: {adapter} {against}", False, why, adapter, decided=False)]
    judge = Judge(name, reference, floors)
    found = [control_check(name, control, runs, judge) for control in controls or []]
    out = []
    for prompt in runs[label]:
        title = f"{name}: {adapter} {prompt[1:]} tokens {against}"
        measured = judge.measure(checks.logprobs(runs, label, prompt), prompt)
        out.append(judge.row(title, adapter, measured))
    out.append(
        effect_check(
            name, adapter, runs, reference.runs, judge.mean_bound, reference.base,
            in_excess=reference.kind == "peft",
            rounding=(floors or {}) if reference.kind == "merged" else None,
        )
    )  # fmt: skip
    return out + found


class Judge:
    """The rule (patchkit.verify.rule) applied to one adapter's answers in one engine:
    its bounds, and whether a miss is decided, from its reference and floors."""

    def __init__(self, engine: str, reference: Reference, floors: dict | None):
        ceiling = ceiling_for(reference.kind)
        self.reference = reference
        self.floors = floors
        self.bounds = bounds_for(floors, ceiling, reference.max_floor)
        self.sure = decisive(floors, ceiling)
        self.mean_sure = mean_decisive(floors)
        self.noise = reference.noise.get(engine, {})
        self.errors = reference.errors.get(engine, {})

    @property
    def mean_bound(self) -> float:
        """The mean distance LoRA may be off (the effect check's resolution): the merged
        reference's bound; for PEFT, PASS_EXCESS x vLLM's own mean base error."""
        if self.reference.kind != "peft" or not self.floors:
            return self.bounds[0]
        return round(PASS_EXCESS * extent(self.floors)[0], 4)

    def measure(self, values: list[float], prompt: str) -> Measured:
        """``values`` on ``prompt`` by the rule; unjudged where the reference's answer, or
        a base answer its noise is made of, is missing or not finite (theirs, not vLLM's)."""
        kind, noise = self.reference.kind, self.noise.get(prompt)
        wanted = finite_answer(self.reference.runs.get(prompt))
        if wanted is None:
            whose = "PEFT's LoRA" if kind == "peft" else "the merged reference"
            return unjudged(f"{whose} answer to this prompt is missing or not finite")
        if kind == "peft" and (noise is None or not math.isfinite(noise)):
            theirs = finite_answer((self.reference.base or {}).get(prompt))
            whose = "vLLM's base" if theirs is not None else "PEFT's base"
            return unjudged(
                f"{whose} answer to this prompt is missing or not finite: no noise to judge it by"
            )
        return measure(values, wanted, kind, self.bounds, noise or 0.0, self.sure,
                       self.mean_sure, self.errors.get(prompt), self.reference.lone)  # fmt: skip

    def row(self, title: str, adapter: str, measured: Measured) -> Check:
        """One prompt's row: inside the bound, or FAILED where the rule decides, else
        undecided and why. An answer as far as a control the run rejects is FAILED here
        with no comparison of its own: a control is rejected only where its distance is
        one the rule fails (rule.measure), and the answer's, no smaller, is one too."""
        if not measured.judged:
            return Check(title, False, measured.text, adapter, decided=False)
        if measured.within:
            return Check(title, True, measured.text, adapter)
        if measured.beyond:
            return Check(title, False, measured.text, adapter)
        detail = measured.text + self._undecided()
        return Check(title, False, detail, adapter, decided=False, by_tokens=measured.by_tokens,
                     past_measured=measured.past_measured)  # fmt: skip

    def _undecided(self) -> str:
        """Why a miss is left open; against PEFT the rule's text says it (Excess.open_because)."""
        if self.reference.kind == "peft":
            return ""
        return (
            ": outside the bound, short of every control this run rejects, and this "
            f"reference's own bf16 rounding ({floor_text(self.floors)}) is too coarse to "
            "call it vLLM's"
        )


def control_check(name: str, control, runs: dict, judge: Judge) -> Check:
    """A control (patchkit.verify.adaptercontrols) served like the adapter: the rule must
    reject it on some prompt (FAILED it, against PEFT; put it past the mean bound, against
    a merged reference whose rounding is small), or the run could not tell it from the
    adapter."""
    title = f"{name}: {control.adapter} control {control.what} rejected"
    error = checks.served_error(runs, control.label)
    if error:
        why = f"not served: {error}"
        return Check(title, False, why, control.adapter, False, control=control.what, served=False)
    measured = {
        prompt: judge.measure(checks.logprobs(runs, control.label, prompt), prompt)
        for prompt in runs[control.label]
        if prompt in judge.reference.runs
    }
    rejected = [(p, m) for p, m in measured.items() if m.rejects]
    if rejected:
        prompt, m = rejected[0]
        value = min(m.scale for _, m in rejected)  # the least distance it was caught at
        why = f"{prompt[1:]} tokens: {m.text}"
        return Check(title, True, why, control.adapter, value=value, control=control.what)
    worst = list(measured.values())[-1].text if measured else "no prompt served"
    if judge.reference.kind == "peft":
        why = f"short of {FAIL_EXCESS}x on every prompt ({worst}): this run cannot tell it apart"
    elif not judge.mean_sure:
        why = (
            f"not rejected ({worst}): this reference's own bf16 rounding "
            f"({floor_text(judge.floors)}) is not known to be small (mean <= {ROUNDING_LIMIT}), "
            "so its bound rejects no control; this reference cannot tell it apart"
        )
    else:
        why = f"inside the bound on every prompt ({worst}): this reference cannot tell it apart"
    return Check(title, False, why, control.adapter, decided=False, control=control.what)


def effect_check(
    name: str,
    adapter: str,
    runs: dict,
    merged: dict,
    bound: float = MERGED_BOUNDS[0],
    reference_base: dict | None = None,
    in_excess: bool = False,
    rounding: dict | None = None,
) -> Check:
    """LoRA moves the output by at least half of what the reference's adapter moves it.

    Served with the adapter silently not applied, LoRA equals base; the
    reference says how far it should be (from its own base answers when it
    has them: PEFT's, else vLLM's). An adapter whose effect is below
    EFFECT_FLOOR cannot be told from noise: undecided, with the reason. The
    bound's share of the effect is reported; the controls decide whether the
    run could tell a weaker adapter apart. ``in_excess``: the PEFT reference, whose
    bound is PASS_EXCESS x vLLM's own base error (``bound``: that in mean units), said so.
    ``rounding``: the merged reference's own bf16 rounding per prompt (its floors; None
    for a reference without one, PEFT's float32): part of the reference's effect may be
    that rounding, so a share short of EFFECT_SHARE is decided only where it is short of
    the effect with the rounding's mean taken off (on the 35B-A3B-wide cut the rounding,
    0.35-0.41, was more than a weak adapter's whole effect).
    """
    label = f"lora:{adapter}"
    title = f"{name}: {adapter} adapter differs from base"
    served, wanted, least = [], [], []
    for prompt in runs[label]:
        base = checks.logprobs(runs, "base", prompt)
        theirs = finite_answer((reference_base or {}).get(prompt)) if reference_base else base
        effect = checks.diff(finite_answer(merged.get(prompt)) or [], theirs or [])[0]
        if not math.isfinite(effect):  # the reference cannot say its effect here
            continue
        served.append(checks.diff(checks.logprobs(runs, label, prompt), base)[0])
        wanted.append(effect)
        if rounding is None:
            least.append(effect)
        elif prompt in rounding:
            least.append(effect - rounding[prompt][0])
    if not wanted:
        why = "the reference has no finite answer (LoRA and base) to any prompt vLLM answered"
        return Check(title, False, why, adapter, decided=False)
    share = min(s / w if w else 0.0 for s, w in zip(served, wanted, strict=True))
    if min(wanted) < EFFECT_FLOOR:
        return Check(
            title,
            False,
            f"the reference's adapter moves log-probs by {min(wanted):.4f} "
            f"only (< {EFFECT_FLOOR}): too little to tell LoRA applied from not",
            adapter,
            decided=False,
        )
    resolution = bound / min(wanted)
    which = f"{PASS_EXCESS}x vLLM's own mean base error ({bound})" if in_excess else "the bound"
    detail = (
        f"mean |LoRA - base| {min(served):.4f}, reference {min(wanted):.4f}; "
        f"smallest share {share:.2f} (>= {EFFECT_SHARE}); {which} is "
        f"{resolution:.0%} of the effect"
    )
    if resolution > RESOLUTION_LIMIT and in_excess:
        detail += f" (> {RESOLUTION_LIMIT:.0%}: the controls say what this run tells apart)"
    elif resolution > RESOLUTION_LIMIT:
        weakest = (
            f"an adapter at {1 - resolution:.0%} of its strength"
            if resolution < 1
            else "an adapter not applied at all"
        )
        detail += (
            f" (> {RESOLUTION_LIMIT:.0%}: {weakest} could pass; the controls say what this "
            "run tells apart)"
        )
    if share >= EFFECT_SHARE:
        return Check(title, True, detail, adapter)
    # short of the share: vLLM's where it is short even of the effect the reference has
    # without its own rounding (all of it where it has none, none where it is unknown)
    decided = len(least) == len(served) and any(
        s < EFFECT_SHARE * w for s, w in zip(served, least, strict=True)
    )
    if not decided:
        detail += (
            f": undecided, the reference's own bf16 rounding ({floor_text(rounding)}) could "
            "make up the rest of its effect"
        )
    return Check(title, False, detail, adapter, decided=decided)


def admission_checks(
    adapters: dict[str, Path], model_dir: Path, tree, finding_words: Callable = str
) -> list[Check]:
    """`patchkit adapter check` of each adapter against the model and the vLLM tree that
    will serve it, as rows: a finding fails the adapter (NaN in a factor, a shape the
    model does not have, what this release refuses), and the run still serves it, so a
    poisoned adapter is also seen failing in serving. ``finding_words`` words a finding's
    message (the CLI's: the words are made there, and verify is below it)."""
    from patchkit.adapters.check import check

    out = []
    for name, path in adapters.items():
        report = check(path, model_dir, target=tree)
        if report.ok:
            detail = f"{report.tensors} tensors, no finding"
            out.append(Check(f"adapter check {name}", True, detail, adapter=name))
        for finding in report.findings:
            where = " ".join(part for part in (finding.file, finding.tensor) if part)
            title = f"adapter check {name}: {finding.kind}"
            out.append(
                Check(title, False, f"{where}: {finding_words(finding.message)}", adapter=name)
            )
    return out
