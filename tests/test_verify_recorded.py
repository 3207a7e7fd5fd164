"""verify's judgement on what vLLM really served: the MoE case of `verify --e2e` on
the 2-GPU H200 (docs/evidence.md), its engines' prompt log-probabilities
recorded (tests/data/h200-2026-11-30h-moe-tp*-served.json.gz and
h200-2026-11-30i-moe-tp2-served.json.gz, the `moe-` entries of served.json).

TP=1 (second sitting) holds the merged reference and its rounding control;
TP=2 (first sitting, before the control existed) holds the reference only,
so it is judged with the TP=1 control's rounding: the reference's precision
is a property of the adapter's merged weights, not of how they are sharded.
These pin the bounds to real numbers: a change to the rule that would fail
this real, correct deployment, or pass it with the adapter left out, fails here.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

from patchkit.verify import engines, modelchecks, references
from tests.helpers import failing

DATA = Path(__file__).parent / "data"


def recorded(tp: int) -> dict:
    path = DATA / f"h200-2026-11-30h-moe-tp{tp}-served.json.gz"
    with gzip.open(path, "rt") as handle:
        return json.load(handle)


def test_the_moe_case_served_at_tp1_passes_against_its_reference_and_control():
    checks = modelchecks.compare(recorded(1), ["moe"], prefix="moe-")
    assert failing(checks) == []
    rows = {c.name: c.detail for c in checks}
    assert "0.0314-0.0400" in rows["moe-reference moe: its own bf16 rounding"]


def test_the_moe_case_served_at_tp2_passes_with_the_tp1_rounding():
    tp1, tp2 = recorded(1), recorded(2)
    floors = references.rounding_floors(engines.Served.from_json(tp1, ["moe"], "moe-"), "moe")
    merged = tp2["moe-merged-moe"]["runs"]["merged"]
    for mode in ("moe-eager", "moe-cudagraph"):
        checks = modelchecks.adapter_checks(mode, "moe", tp2[mode]["runs"], merged, floors)
        assert failing(checks) == [], [c.detail for c in checks]


def test_the_moe_case_served_at_tp2_with_its_own_control_passes():
    """docs/evidence.md (2026-11-30i): TP=2 served its reference and rounding control too,
    and the inference above held: its own control widens the bound as TP=1's did."""
    path = DATA / "h200-2026-11-30i-moe-tp2-served.json.gz"
    with gzip.open(path, "rt") as handle:
        served = json.load(handle)
    checks = modelchecks.compare(served, ["moe"], prefix="moe-")
    assert failing(checks) == []
    rows = {c.name: c.detail for c in checks}
    assert "0.0403-0.0409" in rows["moe-reference moe: its own bf16 rounding"]
    assert "(<= 0.0614)" in rows["moe-eager: moe 600 tokens vs merged"]
    served["moe-eager"]["runs"]["lora:moe"] = copy.deepcopy(served["moe-eager"]["runs"]["base"])
    assert "moe-eager: moe 600 tokens vs merged" in failing(
        modelchecks.compare(served, ["moe"], prefix="moe-")
    )


def test_the_fixed_bound_alone_failed_this_correct_deployment():
    """Why the control exists: without it (mean 0.03) the real MoE run fails."""
    served = recorded(1)
    del served["moe-rounding-moe"]["runs"]
    served["moe-rounding-moe"]["error"] = "not run"
    assert "moe-eager: moe 600 tokens vs merged" in failing(
        modelchecks.compare(served, ["moe"], prefix="moe-")
    )


@pytest.mark.parametrize("mode", ["moe-eager", "moe-cudagraph"])
def test_the_adapter_left_out_fails_on_the_real_numbers(mode):
    """LoRA silently not applied (the base's answers in its place) is far outside the
    widened bound: the control cannot hide a missing adapter."""
    served = recorded(1)
    runs = served[mode]["runs"]
    runs["lora:moe"] = copy.deepcopy(runs["base"])
    failed = failing(modelchecks.compare(served, ["moe"], prefix="moe-"))
    assert f"{mode}: moe 600 tokens vs merged" in failed
    assert f"{mode}: moe adapter differs from base" in failed


def test_the_adapter_at_half_strength_fails_on_the_real_numbers():
    """Half way between base and LoRA (an adapter scaled by about 0.5) fails the bound."""
    served = recorded(1)
    runs = served["moe-eager"]["runs"]
    for prompt, request in runs["lora:moe"].items():
        base = runs["base"][prompt]["prompt_logprobs"]
        request["prompt_logprobs"] = [
            (a + b) / 2 for a, b in zip(request["prompt_logprobs"], base, strict=True)
        ]
    assert "moe-eager: moe 3000 tokens vs merged" in failing(
        modelchecks.compare(served, ["moe"], prefix="moe-")
    )
