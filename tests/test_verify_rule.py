"""verify's rule against transformers + PEFT, on the answers real vLLM engines served.

Two recordings of vLLM 0.26.0 with the default set on the test H200, each with the
transformers + PEFT reference in float32 (tests/data, docs/evidence.md):

- the 35B-A3B-wide cut (8 layers, 256 routed experts top 8), a healthy rank-16 adapter
  ``a0``, its half-strength and experts-ignored controls served beside it;
- the tiny Qwen3.5-MoE of `verify --e2e`, two healthy partial adapters (``down``,
  ``gate_up``).

On the wide cut vLLM's bf16 base is 0.27-0.31 mean from float32, which under the old
rule made every wrong answer INCONCLUSIVE ("within this reference's own noise"). Here:
the healthy adapters' excess (rule.Excess) stands where rule.py says it does, PASSED
with every control FAILED by the same rule, and vLLM's own answers of a wrong LoRA
path (the experts' LoRA dropped, the adapter at half strength: what the controls'
engines served) judged as if they were the adapter's read FAILED, not INCONCLUSIVE.
"""

from __future__ import annotations

import copy

import pytest

from patchkit.cli.verify_words import say as words
from patchkit.codes import Code
from patchkit.verify import engines, references, rule, usermodel
from patchkit.verify.checks import Check
from patchkit.verify.e2e import moe_references
from tests.verify_helpers import CONTROLS, TINY, WIDE_SERVED, excesses, judge_wide, load

MODES = ("eager", "cudagraph")
TINY_SERVED = load(TINY)


def healthy() -> dict[str, list[float]]:
    """Every healthy adapter's excess in the recordings, by run."""
    return {
        "wide a0": [e.ratio for e in excesses(WIDE_SERVED, "", "peft", "lora:a0", "a0")],
        **{
            f"tiny {name}": [
                e.ratio for e in excesses(TINY_SERVED, "moe-", "moe-peft", f"lora:{name}", name)
            ]
            for name in ("down", "gate_up")
        },
    }


# ----- what rule.py says of the recorded healthy adapters -----


def test_the_healthy_excess_recorded_is_what_the_rule_says():
    found = healthy()
    assert sum(len(v) for v in found.values()) == 14  # "14 healthy samples"
    wide = found["wide a0"]
    tiny = found["tiny down"] + found["tiny gate_up"]
    assert 1.20 <= min(wide) and max(wide) <= 1.29  # "1.21-1.28 (35B-A3B-wide, 6)"
    assert 0.89 <= min(tiny) and max(tiny) <= 1.29  # "0.90-1.28 (tiny Qwen3.5-MoE, 8)"


def test_a_healthy_adapter_sits_at_most_71_percent_of_its_bound_and_far_from_failure():
    """The margin: the largest healthy excess recorded against PASS_EXCESS, and none of the
    healthy samples near FAIL_EXCESS (the false-FAILED count is 0 of 14)."""
    every = [r for ratios in healthy().values() for r in ratios]
    assert max(every) / rule.PASS_EXCESS <= 0.715
    assert not [r for r in every if r >= rule.FAIL_EXCESS]
    assert max(every) * 1.7 <= rule.FAIL_EXCESS


def test_every_wrong_lora_path_the_wide_cut_served_is_past_the_failure_line():
    """What vLLM served for the adapter at half strength, with its experts ignored, and
    not at all (the base): FAILED by the excess alone, on every prompt of every engine."""
    for label in ("control:a0+half", "control:a0+no-experts", "base"):
        found = excesses(WIDE_SERVED, "", "peft", label, "a0")
        assert min(e.ratio for e in found) >= rule.FAIL_EXCESS, label


# ----- the verdicts, as `verify --model` reaches them -----


def served_as(label: str) -> dict:
    """The wide run with the adapter's answers replaced, in both engines, by what vLLM
    served for ``label`` (a wrong LoRA path, as a real engine computed it)."""
    served = copy.deepcopy(WIDE_SERVED)
    for mode in MODES:
        runs = served[mode]["runs"]
        runs["lora:a0"] = copy.deepcopy(runs[label])
    return served


def test_the_healthy_wide_adapter_passes_with_every_control_failed_by_the_rule():
    result = judge_wide(WIDE_SERVED)
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("PASSED", "peft"), words(verdict.why)
    assert "the merged reference could not decide" in words(verdict.reference_why)
    assert verdict.caught == ["50 % strength", "experts ignored", "adapter ignored"]
    assert "every control past the failure line (2.2x)" in words(verdict.why)
    nearest = verdict.nearest  # the least excess a control was caught at (cudagraph, 600)
    assert (nearest.what, round(nearest.value, 2)) == ("50 % strength", 2.69)
    rows = {c.name: c for c in result.checks}
    assert "1.24x vLLM's own base error" in rows["eager: a0 4096 tokens vs peft"].detail
    # the effect row says what its bound is against PEFT, not the merged reference's words
    effect = rows["eager: a0 adapter differs from base"].detail
    assert "1.8x vLLM's own mean base error" in effect and "could pass" not in effect


@pytest.mark.parametrize("label", ["control:a0+no-experts", "control:a0+half"])
@pytest.mark.parametrize("with_controls", [True, False])
def test_a_wrong_lora_path_on_the_wide_moe_is_failed_not_inconclusive(label, with_controls):
    """A bug in vLLM's LoRA code (the experts' LoRA skipped) read INCONCLUSIVE, "not a
    failure of vLLM". On vLLM's own answers of such a path: FAILED, by PEFT's excess. The
    merged reference cannot decide it, with its controls or without: its rounding (0.41
    mean) is too coarse to call a miss vLLM's, so a control outside its bound is no wrong
    distance shown (test_verify_engine_recordings: a control near a healthy adapter made
    it FAILED that way)."""
    result = judge_wide(served_as(label), None if with_controls else [])
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED"), words(verdict.why)
    assert verdict.reference == "peft" and "failed from 2.2x" in words(verdict.why)
    assert "the merged reference could not decide" in words(verdict.reference_why)
    assert not any("as far as a control" in c.detail for c in result.checks)


def test_an_answer_in_the_band_is_inconclusive_and_says_what_would_decide():
    """Half way between the healthy answers and the half-strength ones: past the bound,
    short of the failure line and of the weakest control; undecided, never 'not a
    failure of vLLM'."""
    served = copy.deepcopy(WIDE_SERVED)
    for mode in MODES:
        runs = served[mode]["runs"]
        for prompt, request in runs["lora:a0"].items():
            half = runs["control:a0+half"][prompt]["prompt_logprobs"]
            request["prompt_logprobs"] = [
                0.55 * a + 0.45 * b for a, b in zip(request["prompt_logprobs"], half, strict=True)
            ]
    result = judge_wide(served)
    [verdict] = result.adapters
    rows = [c for c in result.checks if c.name.endswith("vs peft") and not c.ok]
    assert verdict.verdict == "INCONCLUSIVE", words(verdict.why)
    assert rows and all(not c.decided for c in rows)
    assert all(c.detail.endswith(": outside the bound, short of 2.2x") for c in rows)
    assert "another --seed" in words(verdict.decides_instead)
    assert verdict.decides_instead.code == Code.VERIFY_DECIDES_OTHER_PROMPTS
    ratios = [float(c.detail.split("x vLLM")[0].rsplit(", ", 1)[1]) for c in rows]
    assert all(rule.PASS_EXCESS < r < rule.FAIL_EXCESS for r in ratios)


def test_the_e2e_moe_partial_adapters_pass_against_peft():
    checks = modelchecks_of_tiny()
    assert not [c.name for c in checks if c.name.endswith("vs peft") and not c.ok]


def modelchecks_of_tiny() -> list:
    from patchkit.verify.e2e import partial_moe_checks

    chosen = moe_references(TINY_SERVED)
    out = []
    for lora in engines.Served.from_json(TINY_SERVED, [], "moe-").lora():
        for name in ("down", "gate_up"):
            out += partial_moe_checks(lora, name, chosen[name])
    return out


def test_a_prompt_without_vllms_base_answer_is_undecided_never_failed():
    """The excess divides by vLLM's own base error on the same prompt: where the engine's
    base answer is missing there is none, and the row is undecided, not FAILED."""
    served = copy.deepcopy(WIDE_SERVED)
    for mode in MODES:
        del served[mode]["runs"]["base"]["p3000"]
    run = engines.Served.from_json(served, ["a0"])
    chosen = {"a0": references.peft_reference(run, "a0", None)}
    result = usermodel.judge(served, ["a0"], {"a0": CONTROLS}, chosen)
    rows = {c.name: c for c in result.checks}
    row = rows["eager: a0 3000 tokens vs peft"]
    assert not row.ok and not row.decided and "no noise to judge it by" in row.detail
    assert result.adapters[0].verdict == "INCONCLUSIVE"


def test_the_verdict_reads_a_rows_fields_never_its_words():
    """Which control a row judges, whether it was served and whether an engine died are
    fields of the row (checks.Check): rows whose words say none of it are read by them, and
    a row whose words look like a control's but whose fields are not is no control."""
    from patchkit.verify.checks import Check

    what = CONTROLS[0].what
    plain = [
        Check("row one", True, "x", "a0", value=2.5, control=what),
        Check("row two", False, "y", "a0", decided=False, control=CONTROLS[1].what, served=False),
        Check(f"e: a0 control {CONTROLS[2].what} rejected", True, "not served: z", "a0"),
    ]
    found = {r.what: r for r in rule.control_results(plain, CONTROLS)}
    assert found[what].rejected is True and found[what].value == 2.5
    assert found[CONTROLS[1].what].rejected is None  # not served, by its field
    assert CONTROLS[2].what not in found  # words alone make no control row
    reference = references.Reference("peft", {}, {}, None)
    died = Check("an engine", False, "boom", engine_down=True)
    verdict = rule.adapter_verdict("a0", [*plain, died], reference, CONTROLS)
    assert verdict.verdict == rule.FAILED and words(verdict.why) == "an engine: boom"
    words_only = Check("e: vLLM ran", False, "boom", decided=False)
    verdict = rule.adapter_verdict("a0", [plain[0], words_only], reference, CONTROLS[:1])
    assert verdict.verdict == rule.PASSED


def test_a_merged_reference_that_decided_without_its_rounding_says_so():
    """The rounding control not served: the merged reference still fails what needs no
    precision (an answer that is not finite), and says its rounding is unknown (not
    small, not coarse)."""
    served = copy.deepcopy(WIDE_SERVED)
    served["rounding-a0"] = {"error": "vLLM (rounding) exited 1: boom"}
    served["eager"]["runs"]["lora:a0"]["p600"]["prompt_logprobs"][5] = float("inf")
    [verdict] = judge_wide(served).adapters
    assert (verdict.verdict, verdict.reference) == ("FAILED", "merged")
    assert "finite" in words(verdict.why)
    assert verdict.reference_why.code == Code.VERIFY_MERGED_DECIDED
    assert words(verdict.reference_why) == (
        "it decided, its own bf16 rounding unknown (no finite distance measured)"
    )


def test_a_row_that_says_not_served_is_marked_not_served():
    """``served`` is the row's fact, the same wherever a row says "not served": a control's
    answers and a repeat's lost in one engine (the data verify --json gives beside it)."""
    served = copy.deepcopy(WIDE_SERVED)
    runs = served["eager"]["runs"]
    del runs["control:a0+half"], runs["base_after_lora"]
    rows = judge_wide(served).checks
    unserved = [c.name for c in rows if not c.served]
    assert len(unserved) == 2, unserved
    assert [c.name for c in rows if c.detail.startswith("not served")] == unserved


def test_a_region_far_off_is_failed_by_its_stretch_though_the_prompt_median_is_inside():
    """The last quarter of a 2048-token prompt three times vLLM's own error, the rest at
    it: the prompt's median says 1.0x, its last 512-token stretch 3.0x, past the failure
    line: FAILED (and a control so served would be caught), the stretch named."""
    base = [0.2] * 2048
    reference = [0.0] * 2048
    values = [0.2] * 1536 + [0.6] * 512
    found = rule.excess(values, reference, 0.2, base)
    assert (round(found.ratio, 6), round(found.stretch, 6)) == (1.0, 3.0)
    assert not found.within(6.0) and found.beyond_noise()
    assert "its worst 512-token stretch 3.00x (failed from 2.2x)" in found.text(6.0)
    measured = rule.measure(values, reference, "peft", (0.3, 6.0), 0.2, True, True, base)
    assert (measured.within, measured.beyond, measured.rejects) == (False, True, True)


def test_an_open_answer_says_what_kept_it_open():
    """Inside by its median and every stretch, out by its worst token: the row says a
    token alone never fails (not "short of 2.2x", which is no reason there); in the band
    by its median: short of 2.2x."""
    reference = [0.0] * 1000
    token = [0.2] * 999 + [5.0]
    measured = rule.measure(token, reference, "peft", (0.3, 2.0), 0.2, True, True, [0.2] * 1000)
    assert (measured.within, measured.beyond) == (False, False)
    assert measured.text.endswith(
        ": its worst token past the max bound (2.0), which alone never fails"
    )
    band = rule.measure([0.4] * 1000, reference, "peft", (0.3, 6.0), 0.2, True, True, [0.2] * 1000)
    assert band.text.endswith(": outside the bound, short of 2.2x")


@pytest.mark.parametrize(
    "tail,why",
    [
        ([7.0], "its worst token past the 6.0-nat ceiling, which alone never fails"),
        ([2.5, 3.0], "more than one token past the max bound (2.0); tokens alone never fail"),
    ],
)
def test_on_a_moe_an_open_answer_says_which_token_bound_kept_it_open(tail, why):
    """With one lone token allowed (rule.MOE_LONE_TOKENS) an answer is open by a second
    token past the max bound, or by its worst past the ceiling, the next inside. The row
    said "more than one token past the max bound" of both, beside "max 7.000, the next
    0.200 (<= 2.0; one token up to 6.0)": one token was."""
    values = [0.2] * (1000 - len(tail)) + tail
    base = [0.2] * 1000
    measured = rule.measure(values, [0.0] * 1000, "peft", (0.3, 2.0), 0.2, True, True, base, 1)
    assert (measured.within, measured.beyond) == (False, False)
    assert measured.text.endswith(f": {why}"), measured.text


def test_a_prompt_shorter_than_two_stretches_is_one_and_the_text_does_not_repeat_it():
    """600 tokens: one stretch, the prompt itself; its excess is the prompt's, not named
    twice. Without vLLM's base error per token there is no stretch to read (0.0)."""
    base = [0.1] * 600
    values = [0.25] * 600
    found = rule.excess(values, [0.0] * 600, 0.1, base)
    assert round(found.stretch, 6) == round(found.ratio, 6) == 2.5
    assert "stretch" not in found.text(6.0)
    assert rule.excess(values, [0.0] * 600, 0.1).stretch == 0.0
    assert rule.stretch_excess([0.1] * 600, [0.1] * 599) == 0.0


def test_the_last_stretch_ends_at_the_prompts_end():
    """1025 tokens (a --max-model-len of 1026 + the answer): stretches of 512.5 tokens.
    Their starts were rounded and a rounded length added, so the last one ended a token
    short (at 1024: 320 lengths of 1024-40000 left their last token out of every stretch,
    and 307 asked for one past the end). Here the last 257 tokens at 3x vLLM's own error
    make the last stretch 3.0x with that token, 2.0x without it."""
    base = [0.1] * 1025
    values = [0.1] * 768 + [0.3] * 257
    assert round(rule.stretch_excess(values, base), 6) == 3.0
    for length in range(1, 20000):
        found = rule.stretches(length)
        assert found[0][0] == 0 and found[-1][1] == length, length
        assert all(hi - lo >= min(length, rule.STRETCH_TOKENS) for lo, hi in found), length
        assert all(b[0] <= a[1] for a, b in zip(found, found[1:], strict=False)), length


def test_a_stretch_decides_only_where_healthy_stretches_are_measured():
    """An 8192-token prompt, vLLM's own error 0.2 everywhere: a region three times that in
    positions 2048-2560 is FAILED (healthy stretches are measured there); the same region
    in 6144-6656, past token 4096, where none is measured, is open, saying so, and what
    would decide it is stretches measured that far."""
    base = [0.2] * 8192
    reference = [0.0] * 8192

    def region(start: int) -> list[float]:
        return [0.6 if start <= i < start + 512 else 0.2 for i in range(8192)]

    early = rule.measure(region(2048), reference, "peft", (0.3, 6.0), 0.2, True, True, base)
    assert (early.within, early.beyond, round(early.scale, 6)) == (False, True, 3.0)
    late = rule.measure(region(6144), reference, "peft", (0.3, 6.0), 0.2, True, True, base)
    assert (late.within, late.beyond, late.past_measured, late.by_tokens) == (
        False, False, True, False
    )  # fmt: skip
    assert "after token 4096, where no healthy stretch is measured yet" in late.text
    peft = references.Reference("peft", {}, {}, None)
    row = Check("eager: a0 8192 tokens vs peft", False, late.text, "a0", decided=False,
                past_measured=True)  # fmt: skip
    decides = rule.decides_instead(peft, [row])
    assert decides.code == Code.VERIFY_DECIDES_MEASURED_STRETCHES
    assert "--max-model-len 4112 decides the first 4096 tokens" in words(decides)
