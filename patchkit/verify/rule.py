"""The decision rule of `verify --model`: how far LoRA may be from its reference, and
the verdict of an adapter from its checks.

Bounds. LoRA served in bf16 computes x W + s (x A^T) B^T: base output and
LoRA output are each rounded to bf16 and added; the merged reference
rounds W + s B A to bf16 once, per weight. Where the delta is small
against W, that rounding moves a weight by up to half a bf16 step of W, a
perturbation of every changed weight; how much it moves the output grows
with the model's width and depth (measured on the test H200: mean
0.012-0.015 on an 8-layer stand-in, 0.032-0.034 on a Qwen3.5-27B-wide
cut; vLLM's own Triton kernels as far from the reference as patchkit's
torch path, docs/evidence.md). A fixed bound is therefore either too
tight for a large model or too loose for a small one, so each adapter gets
a rounding control: the same merge rounded stochastically (an equally
valid bf16 version of the same float32 weights), served like the
reference. How far the two references answer apart is the reference's own
precision, and LoRA may differ from the reference by ROUNDING_FACTOR times
that, never less than MERGED_BOUNDS.

Against transformers + PEFT in float32 the noise is vLLM's own bf16 error, which
on a wide MoE is as large as a wrong LoRA path's distance measured by its mean; that
reference is judged by the excess instead (PASS_EXCESS, FAIL_EXCESS below): FAILED
past the failure line, PASSED within the bound, INCONCLUSIVE only between the two.
Against either reference an answer at least as far as a control the run rejects is
FAILED: the run has just shown that such a distance is a wrong LoRA path. That takes no
comparison of its own: a control is rejected only at a distance measure() fails, so an
answer no nearer fails by the same measure. A control is
rejected by its median excess (PEFT) or its mean (merged), never by its worst token
alone: one token of the reference's own tail would catch a control that changed
nothing as readily as the adapter. Against the merged reference the mean rejects only
where the reference's own rounding is known and small (mean_decisive): outside the
bound of a reference too coarse to call a miss vLLM's, or of one whose rounding did not
run (the bound then falls to MERGED_BOUNDS), a control near the adapter is as far as
the adapter and no farther, and the adapter would be FAILED as far as itself.

Everything that decides lives here, apart from the checks that measure: the
thresholds, the bound (bounds_for), whether a miss is vLLM's fault
(decisive), and the verdict (adapter_verdict, ModelResult.verdict), so the
rule can be replaced as one module.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from patchkit.codes import Code, Reason
from patchkit.verify import checks
from patchkit.verify.checks import (
    FAILED,
    INCONCLUSIVE,
    PASSED,
    AdapterVerdict,
    Check,
    ControlResult,
)
from patchkit.verify.serving import GENERATED

# (mean, max) |LoRA served - merged reference| of prompt log-probabilities that
# always passes, whatever the rounding control says: --e2e's bounds against
# transformers (the 8-layer stand-in measured 0.0116-0.0153 / 0.049-0.098 at
# TP=2, docs/evidence.md).
MERGED_BOUNDS = (0.03, 0.3)
# LoRA vs the reference may reach this many times the distance between the two
# roundings of the reference. Were the output linear in the weights, that distance
# would be about sqrt(3) times the reference's own error (nearest rounding's error
# spread is a step / sqrt(12), the difference's a step / 2), so this allows about
# 2.6 times the reference's error; measured on the H200, LoRA sat at 0.9-1.4
# times the distance (docs/evidence.md)...
ROUNDING_FACTOR = 1.5
# ...unless the roundings differ by more than this (mean): then the reference is
# too coarse to judge a LoRA path by, and the run says so instead of passing on it.
ROUNDING_LIMIT = 0.1
# The max bound never widens past this many nats: in a MoE model a near-tied
# routing choice that flips moves single tokens by up to 1.4 between the two
# roundings, but a bug that breaks a few positions (a chunk boundary, the first
# token) moves them further, and a control with one wild token must not let it by.
# The base rows' bound (patchkit.verify.baserows) stops here too, for the same flips.
MAX_CEILING = 2.0
# Against the transformers + PEFT reference (float32) the floor is vLLM's own error on
# these very prompts, and on a wide MoE it reaches single tokens further than
# MAX_CEILING: on the H200's 35B-A3B-wide cut vLLM base against float32 base moved
# one token by up to 2.80-3.11 nats (a near-tied routing choice of 256 experts that
# bf16 flips), and LoRA against PEFT's LoRA by 1.85-2.69, inside it, while every
# control lay 1.7x the mean bound away (docs/evidence.md). There the max bound is
# ROUNDING_FACTOR x that floor, up to this many nats: a position moved further is
# broken whatever the engine's noise, and past it the max cannot decide.
PEFT_MAX_CEILING = 6.0
# ...and on a model with routed experts its max bound is never below MAX_CEILING: the
# engine's own worst token is one sample of a heavy tail, and a mild sample made a tight
# bound (the tiny Qwen3.5-MoE of `verify --e2e`: base at most 0.98 nats off on 3000
# tokens, a bound of 1.47, its healthy adapters' single tokens at 1.95 and 1.54)...
PEFT_MOE_MAX_FLOOR = MAX_CEILING
# ...and there this many tokens of a prompt may lie past that bound, up to the ceiling:
# the worst of a few thousand tokens is one sample of the tail, the second a sharper one.
# On the test H100's 35B-A3B-wide cut the healthy adapter's worst token stood at 1.8-3.9
# nats over five seeds; at seed 2 one token of the 4096-token prompt lay past the bound
# (3.854 against 1.5 x the engine's own worst, 2.106: INCONCLUSIVE on that token alone),
# while no healthy answer there or on the tiny MoE put a second token past it (0.80 of
# the bound at most). A wrong path on a few positions moves more than one: on the tiny
# MoE 40 tokens moved 5.9 nats stay outside, as they did.
MOE_LONE_TOKENS = 1
# LoRA must move the output by at least this share of what the merged adapter does...
EFFECT_SHARE = 0.5
# ...and the adapter must move it clearly more than bf16 noise, or the check cannot tell...
EFFECT_FLOOR = 0.01
# ...and clearly more than the bound allows LoRA to be off, or an adapter applied at
# a fraction of its strength would pass (on the H200 the bound was 9-12 % of the
# effect: MoE 0.06 of 0.60, 27B-wide `full` 0.052 of 0.45, `attn-mlp` 0.03 of 0.25).
RESOLUTION_LIMIT = 0.25


# Against transformers + PEFT (float32) vLLM's own bf16 error is the noise, and on a
# wide MoE it is large: on the 35B-A3B-wide cut a near-tied routing choice of 256 experts
# that bf16 flips moves tokens by nats, and the mean |vLLM base - PEFT base| is 0.27-0.31.
# A mean bound of 1.5 x that could not fail anything (a bug's distance and the noise
# grew together), so this reference is judged by another statistic: the median over the
# prompt's tokens of |vLLM LoRA - PEFT LoRA| in units of the same median of |vLLM base -
# PEFT base| on the same prompt and engine (the excess). The median leaves out the few
# tokens a routing flip throws far; a wrong LoRA path moves every token. Recorded healthy
# adapters (tests/test_verify_rule.py): 0.90-1.28 (tiny Qwen3.5-MoE, 8 engine x prompt
# samples) and 1.21-1.28 (35B-A3B-wide, 6); the controls served beside them 2.69 and more.
# PASSED at or below PASS_EXCESS (the largest healthy excess is 71 % of it)...
PASS_EXCESS = 1.8
# ...FAILED at or beyond FAIL_EXCESS on any prompt of any engine: 1.7 x the largest
# healthy excess recorded, which none of the 14 healthy samples reached; between the
# two, INCONCLUSIVE (a control the run caught is past FAIL_EXCESS itself).
FAIL_EXCESS = 2.2
# The excess is also taken over each stretch of the prompt of about this many tokens (equal
# stretches, as many as fit, each overlapping the next by half; the whole prompt when it is
# shorter than two): a bug that
# breaks a region (a chunk, the positions past some length) moves every token there but
# few of the prompt's, and the prompt's median hides it. A stretch at or past FAIL_EXCESS
# is FAILED as the prompt would be: the same statistic over fewer tokens, and healthy
# stretches stand far from it (no recorded one past 71 % of the line; the same answers cut
# to any other prompt length from 1024 tokens, where the stretches fall elsewhere, 82 %). On the
# test H100 (35B-A3B-wide cut, five seeds, 30 prompt x engine samples) the healthy
# adapter's worst stretch stood at 1.09-1.57x; with a wrong LoRA path (any of the six
# controls' answers) on the last 10 % of the 4096-token prompt, at 2.29-3.53x (four
# seeds, both engines). A broken region must cover most of one stretch: 576 wrong tokens
# inside one are caught, and astride two (288 in each) by the one between; with the
# stretches side by side that region passed.
STRETCH_TOKENS = 512
# ...and it decides FAILED only where healthy stretches have been measured: in stretches
# ending by this position (the recordings' longest prompt). Past it a stretch at or past
# FAIL_EXCESS keeps the answer from PASSED, open: along the 4096-token prompts vLLM's own
# base error falls (0.196-0.199 to 0.184) and the healthy excess drifts up about 1.8 % of
# the prompt's every 512 tokens; carried on to 16k tokens that could reach the line, so
# the rule does not fail there what it has not measured.
STRETCH_MEASURED_TO = 4096
# The least noise the excess divides by: where vLLM base and PEFT base agree to the last
# bit on most tokens, a median of 0 would make any LoRA rounding infinitely far.
LEAST_NOISE = 1e-3


def median_distance(values: list[float], reference: list[float]) -> float:
    """The median |values - reference| over the tokens (inf when lengths differ, a value
    is NaN, or there is none)."""
    found = [abs(x - y) for x, y in zip(values, reference, strict=False)]
    if len(values) != len(reference) or not found or any(math.isnan(d) for d in found):
        return float("inf")
    return statistics.median(found)


def stretch_excess(
    distances: list[float], base: list[float] | None, upto: int | None = None
) -> float:
    """The largest median excess over the prompt's stretches of about STRETCH_TOKENS
    tokens: ``distances`` (an answer against PEFT's, per token) in units of ``base``
    (vLLM base against PEFT base, per token) on the same stretch; with ``upto``, over the
    stretches ending by that position only. The stretches overlap by half, so a region
    astride two of them is most of a third. 0.0 without ``base``, when the two are not
    of one length (nothing to compare a stretch with), or with no stretch by ``upto``."""
    return largest(stretch_excesses(distances, base), upto)


def largest(found: list[tuple[int, float]], upto: int | None = None) -> float:
    """The largest of stretch_excesses' excesses; with ``upto``, of the stretches ending
    by that position only; 0.0 with none."""
    return max((x for end, x in found if upto is None or end <= upto), default=0.0)


def stretch_excesses(distances: list[float], base: list[float] | None) -> list[tuple[int, float]]:
    """Each stretch's (end, median excess), for stretch_excess; [] without ``base`` or
    when the two are not of one length."""
    if not base or len(base) != len(distances):
        return []
    return [
        (hi, statistics.median(distances[lo:hi]) / max(statistics.median(base[lo:hi]), LEAST_NOISE))
        for lo, hi in stretches(len(distances))
    ]


def stretches(length: int) -> list[tuple[int, int]]:
    """The stretches of a prompt of ``length`` tokens, (start, end): as many equal ones of
    at least STRETCH_TOKENS as fit (the whole prompt when it is shorter than two), each
    starting half way into the one before. Ends are rounded, not lengths, so the last one
    ends at the prompt's end, never a token short of it or past it."""
    count = max(1, length // STRETCH_TOKENS)
    size = length / count
    return [(round(i * size / 2), round(i * size / 2 + size)) for i in range(2 * count - 1)]


@dataclass(frozen=True)
class Excess:
    """One answer against the PEFT reference on one prompt of one engine: its median
    distance, vLLM's own base error there (the noise), its worst token, and its largest
    excess over a stretch of the prompt (stretch_excess)."""

    distance: float
    noise: float
    worst: float
    stretch: float = 0.0
    next_worst: float = 0.0  # the second-largest token's distance
    measured_stretch: float = 0.0  # the largest over stretches ending by STRETCH_MEASURED_TO

    @property
    def ratio(self) -> float:
        return self.distance / max(self.noise, LEAST_NOISE)

    @property
    def farthest(self) -> float:
        """How far the rule found the answer: the prompt's excess, or a stretch's where the
        stretch alone is past the failure line (a control caught by a region is caught
        there, not at the prompt's median short of the line)."""
        if self.ratio < FAIL_EXCESS <= self.measured_stretch:
            return self.measured_stretch
        return self.ratio

    def within(self, max_bound: float, lone: int = 0) -> bool:
        """Inside: the median, every stretch, and the worst token within the max bound,
        or with ``lone`` (MOE_LONE_TOKENS), the next token within it and the worst within
        the ceiling."""
        if lone:
            tail = self.worst <= PEFT_MAX_CEILING and self.next_worst <= max_bound
        else:
            tail = self.worst <= max_bound
        return self.ratio <= PASS_EXCESS and self.stretch < FAIL_EXCESS and tail

    def beyond_noise(self) -> bool:
        """Farther than vLLM's own error explains, over the prompt or over a stretch of it
        where healthy stretches are measured: FAILED, whatever else the run says."""
        return self.ratio >= FAIL_EXCESS or self.measured_stretch >= FAIL_EXCESS

    @property
    def open_past_measured(self) -> bool:
        """Open by a stretch past the line where no healthy stretch is measured yet."""
        return self.stretch >= FAIL_EXCESS and not self.beyond_noise()

    def open_because(self, max_bound: float, lone: int = 0) -> str:
        """Why an answer neither inside nor beyond is undecided, in the report's words."""
        if self.open_past_measured:
            return (
                f"a stretch past {FAIL_EXCESS}x after token {STRETCH_MEASURED_TO}, where no "
                "healthy stretch is measured yet: a region broken there, or vLLM's own "
                "error changing along a long prompt"
            )
        if self.ratio > PASS_EXCESS:
            return f"outside the bound, short of {FAIL_EXCESS}x"
        if not lone:
            return f"its worst token past the max bound ({max_bound}), which alone never fails"
        if self.next_worst > max_bound:
            return f"more than one token past the max bound ({max_bound}); tokens alone never fail"
        return f"its worst token past the {PEFT_MAX_CEILING}-nat ceiling, which alone never fails"

    def text(self, max_bound: float, lone: int = 0) -> str:
        """The numbers the rule read; a stretch only where it is past PASS_EXCESS (below
        that it decides nothing the prompt's median does not) and not the prompt's own
        median (a prompt of one stretch)."""
        stretch = ""
        if self.stretch > PASS_EXCESS and f"{self.stretch:.2f}" != f"{self.ratio:.2f}":
            stretch = (
                f", its worst {STRETCH_TOKENS}-token stretch {self.stretch:.2f}x "
                f"(failed from {FAIL_EXCESS}x)"
            )
        return (
            f"median |d logprob| {self.distance:.4f}, {self.ratio:.2f}x vLLM's own base error "
            f"{self.noise:.4f} (<= {PASS_EXCESS}x; failed from {FAIL_EXCESS}x){stretch}, "
            + self._tail_text(max_bound, lone)
        )

    def _tail_text(self, max_bound: float, lone: int) -> str:
        if not lone:
            return f"max {self.worst:.3f} (<= {max_bound})"
        return (
            f"max {self.worst:.3f}, the next {self.next_worst:.3f} (<= {max_bound}; "
            f"{'one token' if lone == 1 else f'{lone} tokens'} up to {PEFT_MAX_CEILING})"
        )


def excess(
    values: list[float], reference: list[float], noise: float, base: list[float] | None = None
) -> Excess:
    """The Excess of ``values`` against ``reference`` given this prompt's noise, and its
    stretches against ``base`` (vLLM's base error per token on this prompt), if given."""
    distances = [abs(x - y) for x, y in zip(values, reference, strict=False)]
    found = stretch_excesses(distances, base) if len(values) == len(reference) else []
    stretch, measured = largest(found), largest(found, STRETCH_MEASURED_TO)
    worst = checks.diff(values, reference)[1]
    ranked = sorted(distances, reverse=True)
    next_worst = worst if len(ranked) < 2 or math.isinf(worst) else ranked[1]
    distance = median_distance(values, reference)
    return Excess(distance, noise, worst, stretch, next_worst, measured)


@dataclass(frozen=True)
class Measured:
    """One answer (an adapter's, or a control's) against its reference on one prompt of
    one engine, as the rule reads it."""

    within: bool  # inside the bound: what PASSED needs on every prompt
    beyond: bool  # outside it and past what the reference's noise explains: FAILED
    rejects: bool  # what makes a control caught: beyond (PEFT), past the mean bound (merged)
    scale: float  # how far, in the unit answers are compared in (excess, or mean)
    text: str
    judged: bool = True  # False: nothing to compare with (text says whose answer is missing)
    by_tokens: bool = False  # open by tokens alone (Excess.open_because): no prompt fails it
    past_measured: bool = False  # open by a stretch past STRETCH_MEASURED_TO alone


def unjudged(why: str) -> Measured:
    """A prompt the reference cannot judge (its answer, or a base answer the noise needs,
    missing or not finite): neither inside nor outside, and no failure of vLLM."""
    return Measured(False, False, False, float("nan"), why, judged=False)


def finite_answer(request) -> list[float] | None:
    """A served request's prompt log-probabilities, or None when there is none or one of
    them is NaN or infinite (a reference that cannot judge that prompt)."""
    values = request.get("prompt_logprobs") if isinstance(request, dict) else None
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return values


def measure(
    values,
    reference,
    kind: str,
    bounds,
    noise: float,
    sure: bool,
    mean_sure: bool,
    base: list[float] | None = None,
    lone: int = 0,
):
    """``values`` against ``reference`` on one prompt: against the PEFT reference by the
    excess over vLLM's own base error (``noise``; ``base``, per token, for the stretches;
    ``lone`` tokens past the max bound up to the ceiling, MOE_LONE_TOKENS on a MoE);
    against the merged one by the mean and max bound, a miss decided when the reference is
    precise (``sure``: decisive), a control rejected by a mean it can judge (``mean_sure``:
    mean_decisive)."""
    if kind == "peft":
        found = excess(values, reference, noise, base)
        within = found.within(bounds[1], lone)
        # a worst token alone never decides FAILED here: one sample of a heavy tail (a
        # routing flip); it keeps the answer from PASSED. The median decides, over the
        # prompt or over a stretch of it (a region broken)
        beyond = not within and found.beyond_noise()
        text = found.text(bounds[1], lone)
        open_ = not within and not beyond
        if open_:
            text += f": {found.open_because(bounds[1], lone)}"
        by_tokens = open_ and found.ratio <= PASS_EXCESS and not found.open_past_measured
        past = open_ and found.open_past_measured
        return Measured(within, beyond, beyond, found.farthest, text, by_tokens=by_tokens,
                        past_measured=past)  # fmt: skip
    mean, worst = checks.diff(values, reference)
    within = mean <= bounds[0] and worst <= bounds[1]
    text = f"mean |d logprob| {mean:.4f} (<= {bounds[0]}), max {worst:.3f} (<= {bounds[1]})"
    # a control is caught by its mean, as against PEFT by its median: one worst token
    # would make a control that changed nothing (a fault that did not take) "rejected"
    # wherever the reference's own tail puts the adapter outside the max bound too, and
    # the adapter then FAILED as far as it; and only by a mean the reference can judge
    # (mean_sure): outside a bound its own rounding does not make a fail line, a
    # control near the adapter is caught wherever the adapter is out too
    rejects = mean > bounds[0] and mean_sure
    # a miss by the mean is vLLM's where the mean is (mean_sure), whether or not the
    # ceiling cut the max bound: that cut leaves a worst token undecided, not a mean
    return Measured(within, not within and sure or rejects, rejects, mean, text)


def extent(floors: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """The largest (mean, max) distance over the prompts of non-empty ``floors``: the
    reference's precision as one perturbation, taken whole (bounds_for says why)."""
    return max(f[0] for f in floors.values()), max(f[1] for f in floors.values())


def ceiling_for(kind: str) -> float:
    """The max bound's ceiling for a reference kind: MAX_CEILING for the merged one,
    PEFT_MAX_CEILING for transformers + PEFT (the engine's own error is its floor)."""
    return PEFT_MAX_CEILING if kind == "peft" else MAX_CEILING


def bounds_for(
    floors: dict[str, tuple[float, float]] | None,
    ceiling: float = MAX_CEILING,
    max_floor: float = MERGED_BOUNDS[1],
) -> tuple[float, float]:
    """MERGED_BOUNDS (the max at least ``max_floor``), widened to ROUNDING_FACTOR x the
    reference's own rounding.

    The rounding is one perturbation of the adapter's weights, so its size is
    taken over all prompts (the largest mean and max), not prompt by prompt:
    one prompt's distance is a sample of it, and in a MoE model a sample that
    a few routing flips decide (on the H200 the MoE reference's two roundings
    differed by 0.031 on 600 tokens and 0.040 on 3000).
    """
    if not floors:
        return MERGED_BOUNDS[0], max_floor
    mean, worst = extent(floors)
    return (
        max(MERGED_BOUNDS[0], round(ROUNDING_FACTOR * mean, 4)),
        min(ceiling, max(max_floor, round(ROUNDING_FACTOR * worst, 3))),
    )


def decisive(floors: dict[str, tuple[float, float]] | None, ceiling: float = MAX_CEILING) -> bool:
    """Whether LoRA outside the bound is vLLM's fault: the reference's own distance from
    vLLM is small (mean <= ROUNDING_LIMIT) and the max bound was not cut below
    ROUNDING_FACTOR x it by MAX_CEILING. Otherwise a LoRA answer outside the bound
    may be the reference's own noise: INCONCLUSIVE, not FAILED; unless it is outside by
    its mean and the mean alone is decisive (mean_decisive)."""
    return mean_decisive(floors) and ROUNDING_FACTOR * extent(floors)[1] <= ceiling


def mean_decisive(floors: dict[str, tuple[float, float]] | None) -> bool:
    """Whether a mean outside the bound is more than the reference's own rounding: that
    rounding was measured (a rounding control that did not run leaves the bound at
    MERGED_BOUNDS, which says nothing of this model) and its mean is small. The max
    ceiling bounds the worst token only and does not enter here."""
    return bool(floors) and extent(floors)[0] <= ROUNDING_LIMIT


def floor_text(floors: dict | None) -> str:
    if not floors:
        return "unknown: no finite distance measured"
    mean, worst = extent(floors)
    return f"mean {mean:.4f}, max {worst:.3f}"


@dataclass
class ModelResult:
    """`verify --model`'s result: every check, and a verdict per adapter."""

    checks: list[Check]
    adapters: list[AdapterVerdict]

    @property
    def verdict(self) -> str:
        """FAILED if a check of an engine or the run failed, or an adapter did; else
        INCONCLUSIVE if an adapter is; else PASSED."""
        engine_failed = any(c.failed for c in self.checks if c.adapter is None)
        found = [a.verdict for a in self.adapters]
        return checks.overall([*found, FAILED] if engine_failed else found)


def adapter_verdict(adapter: str, found: list[Check], reference, controls) -> AdapterVerdict:
    """One adapter's verdict from its checks (those of every LoRA engine and of its
    reference): FAILED on a decided failure, INCONCLUSIVE on a check its reference
    could not decide (a control inside the bound among them), else PASSED.
    ``reference`` is the adapter's patchkit.verify.references.Reference (its kind and
    why are what the verdict reports; not imported: references builds on this rule)."""
    mine = [c for c in found if c.adapter == adapter]
    results = control_results(mine, controls)
    failed = [c for c in mine if c.failed]
    crashed = [c for c in found if c.adapter is None and c.failed and c.engine_down]
    open_ = [c for c in mine if not c.ok]
    decides = None
    if failed or crashed:
        first = (crashed or failed)[0]
        verdict = FAILED
        why = Reason.of(Code.VERIFY_CHECK_FAILED, check=first.name, detail=first.detail)
    elif open_:
        verdict = INCONCLUSIVE
        why = Reason.of(Code.VERIFY_CHECK_OPEN, check=open_[0].name, detail=open_[0].detail)
        decides = decides_instead(reference, open_)
    else:
        verdict, why = PASSED, within(reference.kind, bool(results))
    return AdapterVerdict(
        adapter, verdict, reference.kind, reference.why, why, decides, results,
        unit_of(reference.kind),
    )  # fmt: skip


def decides_instead(reference, open_: list[Check]) -> Reason:
    """What would decide an open verdict: the PEFT reference, for the merged one; the PEFT
    reference running, where it did not (no seed makes it run); other prompts that pass
    it, where only tokens keep its ``open_`` rows open (no prompt fails a token); else
    other prompts, on one side of the band."""
    if reference.kind == "merged":
        return Reason.of(Code.VERIFY_DECIDES_PEFT)
    if reference.runs is None:
        return Reason.of(Code.VERIFY_DECIDES_REFERENCE_RUN, missing=reference.missing)
    if open_ and all(c.by_tokens for c in open_):
        return Reason.of(Code.VERIFY_DECIDES_TOKENS, lone=reference.lone, ceiling=PEFT_MAX_CEILING)
    if open_ and all(c.past_measured for c in open_):
        return Reason.of(Code.VERIFY_DECIDES_MEASURED_STRETCHES, upto=STRETCH_MEASURED_TO,
                         max_model_len=STRETCH_MEASURED_TO + GENERATED)  # fmt: skip
    return Reason.of(Code.VERIFY_DECIDES_OTHER_PROMPTS)


def within(kind: str, controls: bool) -> Reason:
    """PASSED's reason: within the reference's bound, and where every control fell."""
    where = None
    if controls:
        where = "past-failure-line" if kind == "peft" else "outside"
    return Reason.of(Code.VERIFY_WITHIN, reference=kind, controls=where, fail_excess=FAIL_EXCESS)


def control_results(mine: list[Check], controls) -> list[ControlResult]:
    """Each control: rejected when every engine rejected it, None when one did not serve it."""
    out = []
    for control in controls:
        rows = [c for c in mine if c.control == control.what]
        if not rows:
            continue
        if not all(c.served for c in rows):
            out.append(ControlResult(control.what, None, rows[0].detail))
            continue
        misses = [c for c in rows if not c.ok]
        values = [c.value for c in rows if c.value is not None]
        value = min(values) if values and not misses else None
        out.append(ControlResult(control.what, not misses, (misses or rows)[0].detail, value))
    return out


def unit_of(kind: str) -> str:
    """How a control's value reads: the excess against PEFT, the mean against the merge."""
    return "x vLLM's own base error" if kind == "peft" else " mean |d logprob|"
