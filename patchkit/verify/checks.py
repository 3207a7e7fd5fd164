"""The checks `verify --e2e` and `verify --model` apply to what vLLM served.

Both judge teacher-forced prompt log-probabilities, not generated tokens:
random weights (the e2e models) and tensor parallelism (a different
reduction order) turn near-ties into different greedy tokens while the
log-probabilities stay within bf16 rounding. A served result is
``{"corrupted_requests": n, "runs": {label: {prompt: request} | {"error": ...}}}``
with a request ``{"prompt_logprobs", "tokens", "token_logprobs"}``
(patchkit.verify.serving writes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from patchkit.codes import Reason
from patchkit.symptoms import ZERO_RUN_RANDOM, longest_zero_run

# The same request twice (before/after other requests) must agree within
# run-to-run noise: the Triton shrink kernel sums split-k partials with
# atomic adds (order not fixed), which moved a 50-token prompt's log-probs by
# up to 8e-3 on the test H200. Carried-over GDN state or a stale adapter slot
# moves them by about the LoRA effect (0.3 in the e2e models).
REPEAT_MAX_TOL = 0.05


@dataclass
class Check:
    """One named pass/fail with the number that decided it.

    ``decided`` False marks a check that did not pass because its reference
    could not tell (too coarse, or a control it could not reject): not a
    failure of vLLM, an INCONCLUSIVE for the adapter it belongs to. ``adapter``
    names that adapter; None for a check of an engine or of the whole run.
    """

    name: str
    ok: bool
    detail: str
    adapter: str | None = None
    decided: bool = True
    # a control's row: the least distance the rule caught it at, over the prompts where
    # it did (the excess against PEFT, the mean against the merged reference)
    value: float | None = None
    # what the row is, as fields (the rule reads these, never the row's words): the
    # control it judges ("50 % strength"), whether what it judges was served at all,
    # and whether it says an engine did not run
    control: str | None = None
    served: bool = True
    # an open row whose median and every stretch are inside: tokens alone keep it open,
    # and no prompt fails it (what decides it is other prompts that pass it)
    by_tokens: bool = False
    # an open row kept open only by a stretch past the line after the positions where
    # healthy stretches are measured (rule.STRETCH_MEASURED_TO)
    past_measured: bool = False
    engine_down: bool = False

    @property
    def failed(self) -> bool:
        """Did not pass, and the reference could tell: a finding, not an open question."""
        return not self.ok and self.decided


# The three verdicts of `verify`, per adapter and for the whole run.
PASSED, FAILED, INCONCLUSIVE = "PASSED", "FAILED", "INCONCLUSIVE"


def overall(verdicts: list[str]) -> str:
    """FAILED if any is, else INCONCLUSIVE if any is, else PASSED (also for none)."""
    if FAILED in verdicts:
        return FAILED
    return INCONCLUSIVE if INCONCLUSIVE in verdicts else PASSED


@dataclass
class ControlResult:
    """One control of an adapter (the adapter changed as a bug would change it) judged
    against the adapter's reference: ``rejected`` when the verdict would have failed it,
    False when it fell inside the bound, None when it was not served."""

    what: str  # "50 % strength", "experts ignored", "adapter ignored"
    rejected: bool | None
    detail: str
    value: float | None = None  # how far it was, in every engine (the least of theirs)


@dataclass(frozen=True)
class AdapterVerdict:
    """What `verify --model` decided for one adapter, and why."""

    adapter: str
    verdict: str  # PASSED, FAILED or INCONCLUSIVE
    reference: str  # "merged" or "peft": what LoRA was judged against
    reference_why: Reason | None  # why that reference (chosen, or forced by --reference)
    why: Reason  # the reason for the verdict
    decides_instead: Reason | None = None  # for INCONCLUSIVE: what would decide
    controls: list[ControlResult] = field(default_factory=list)
    unit: str = ""  # the unit of the controls' values ("x vLLM's own base error", ...)

    def __post_init__(self) -> None:
        """The verdict's reasons are values; their words are made by the command line."""
        for name in ("reference_why", "why", "decides_instead"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Reason):
                raise TypeError(f"a verdict's {name} is a Reason, not {type(value).__name__}")

    @property
    def nearest(self) -> ControlResult | None:
        """The caught control nearest the adapter's reference: the smallest wrong path this
        run told apart, its resolution."""
        caught = [c for c in self.controls if c.rejected and c.value is not None]
        return min(caught, key=lambda c: c.value) if caught else None

    @property
    def caught(self) -> list[str]:
        """The controls the run rejected: what it could tell apart from the adapter."""
        return [c.what for c in self.controls if c.rejected]

    @property
    def missed(self) -> list[str]:
        """The controls the run could not reject (inside the bound, or not served)."""
        return [c.what for c in self.controls if not c.rejected]


def diff(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and max absolute difference (inf when lengths differ or a value is NaN)."""
    if len(a) != len(b) or not a:
        return float("inf"), float("inf")
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    if any(d != d for d in diffs):
        return float("inf"), float("inf")
    return sum(diffs) / len(diffs), max(diffs)


def count_nan(values: list[float]) -> int:
    return sum(1 for v in values if v != v)


def served_error(runs: dict, label: str) -> str | None:
    """Why ``label``'s requests have no results (an adapter that did not load), or None."""
    group = runs.get(label)
    if group is None:
        return "not run"
    return group.get("error")


def logprobs(runs: dict, label: str, prompt: str) -> list[float]:
    """The prompt log-probabilities of one request; [] when it was not served."""
    group = runs.get(label) or {}
    request = group.get(prompt)
    return request["prompt_logprobs"] if isinstance(request, dict) else []


def engine_ran(name: str, served: dict) -> list[Check]:
    """[] when the engine ran; else the failed check, and a second start noted when one ran."""
    if "error" in served:
        return [Check(f"{name}: vLLM ran", False, served["error"], engine_down=True)]
    if "first_attempt" in served:
        return [
            Check(f"{name}: engine started (second attempt, alone)", True, served["first_attempt"])
        ]
    return []


def health_checks(name: str, served: dict) -> list[Check]:
    """No NaN counted by vLLM, none in the log-probabilities, no run of token 0."""
    corrupted = served["corrupted_requests"]
    checks = [
        Check(
            f"{name}: vllm:corrupted_requests",
            corrupted == 0,
            f"{corrupted} (VLLM_COMPUTE_NANS_IN_LOGITS=1)",
        )
    ]
    every = [
        (label, r)
        for label, group in served["runs"].items()
        for r in group.values()
        if isinstance(r, dict)
    ]
    nan = [(label, count_nan(r["prompt_logprobs"] + r["token_logprobs"])) for label, r in every]
    nan_total = sum(n for _, n in nan)
    checks.append(
        Check(
            f"{name}: no NaN log-probabilities",
            nan_total == 0,
            f"{nan_total} NaN" + _naming([label for label, n in nan if n]),
        )
    )
    zero_runs = [label for label, r in every if longest_zero_run(r["tokens"]) >= ZERO_RUN_RANDOM]
    checks.append(
        Check(
            f"{name}: no run of token id 0",
            not zero_runs,
            f"{len(zero_runs)} output{'s' if len(zero_runs) != 1 else ''} with "
            f">= {ZERO_RUN_RANDOM} zeros in a row" + _naming(zero_runs),
        )
    )
    return checks


def _naming(labels: list[str]) -> str:
    """' (in lora:poisoned, ...)': which requests of an engine went bad, so an
    engine-wide row still names the adapter (the engine serves them all)."""
    names = list(dict.fromkeys(labels))
    return f" (in {', '.join(names)})" if names else ""


def bound_check(title: str, values: list[float], reference: list[float], bounds) -> Check:
    """``values`` within (mean, max) absolute difference ``bounds`` of ``reference``."""
    mean_tol, max_tol = bounds
    mean, worst = diff(values, reference)
    return Check(
        title,
        mean <= mean_tol and worst <= max_tol,
        f"mean |d logprob| {mean:.4f} (<= {mean_tol}), max {worst:.3f} (<= {max_tol})",
    )


def repeat_check(name: str, runs: dict, again: str, first: str, title: str) -> Check:
    """The same request later in the run answers as it did first (no state carried over)."""
    missing = served_error(runs, again) or served_error(runs, first)
    if missing:
        return Check(f"{name}: {title}", False, f"not served: {missing}", served=False)
    names = list(runs[again])
    lost = [n for n in names if not isinstance(runs[first].get(n), dict)]
    if lost:
        why = f"not served: {first} has no answer to {lost[0]}"
        return Check(f"{name}: {title}", False, why, served=False)
    worst = max(diff(logprobs(runs, again, n), logprobs(runs, first, n))[1] for n in names)
    same_tokens = all(runs[again][n]["tokens"] == runs[first][n]["tokens"] for n in names)
    return Check(
        f"{name}: {title}",
        worst <= REPEAT_MAX_TOL and same_tokens,
        f"max |d logprob| {worst:.2e} (<= {REPEAT_MAX_TOL}), tokens equal: {same_tokens}",
    )


def rows_check(title: str, runs: dict, labels: list[str]) -> Check:
    """The requests of ``labels`` (one adapter's) answered finite, with no run of token 0.

    The engine-wide rows of health_checks name the labels too; this one belongs
    to an adapter, so a poisoned adapter fails itself and not the others served
    by the same engine.
    """
    every = [r for label in labels for r in (runs.get(label) or {}).values() if isinstance(r, dict)]
    bad = sum(
        1
        for r in every
        if any(not math.isfinite(v) for v in r["prompt_logprobs"] + r["token_logprobs"])
    )
    zeros = sum(1 for r in every if longest_zero_run(r["tokens"]) >= ZERO_RUN_RANDOM)
    return Check(
        f"{title}: finite, no run of token id 0",
        not bad and not zeros,
        f"{bad} request(s) with NaN or inf log-probabilities, {zeros} with >= {ZERO_RUN_RANDOM} "
        "zeros in a row",
    )
