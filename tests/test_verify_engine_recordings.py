"""verify's rule on the answers of three `verify --model` runs on the test H100 (2026-12-07).

vLLM 0.26.0 with the default set, Model Runner V1; the 35B-A3B-wide cut (8 layers,
256 routed experts top 8) and its healthy rank-16 adapter ``a0``; the transformers +
PEFT reference in float32 (tests/data, docs/evidence.md "verify on the 35B-A3B-wide
MoE with engine-side controls"):

- ``healthy``: seed 11, verify's own choice of reference (the merged one undecided,
  PEFT chosen), the three adapter-side controls and the four engine-side ones
  (patchkit.verify.enginefaults) served in the run's own two LoRA engines;
- ``healthy-seed1``: the same with --seed 1;
- ``engine-bug``: seed 11, --reference peft, on a copy of vLLM with
  scripts/proofs/inject_engine_bug.py's bug (the packed layers' set_lora loop stops
  one slice short): a bug of no kind the controls make;
- ``healthy-seed2`` and ``healthy-seed3``: the healthy run at seeds 2 and 3, a later
  sitting of that day (docs/evidence.md, h100-2026-12-07d): the H100 printed seed 2
  INCONCLUSIVE on one worst token, which the rule now allows (rule.MOE_LONE_TOKENS).

Each served.json was put together from the engines' result files under --keep (the
sitting's archive left served.json itself out by size); the first test shows it is
what verify judged: every row and verdict line of the three reports, from it.
"""

from __future__ import annotations

import copy
import json
import random
import re
import statistics
from pathlib import Path

import pytest

from patchkit.cli.commands.verify import adapter_verdict_lines, check_table
from patchkit.cli.verify_words import say as words
from patchkit.codes import Code
from patchkit.verify import adaptercontrols, engines, references, rule, usermodel
from patchkit.verify.adaptercontrols import HALF, IGNORED, NO_EXPERTS, Control
from tests.verify_helpers import DATA, excesses, judge_wide, load

RUNS = {
    "healthy": ("h100-2026-12-07c-wide35b-healthy-served.json.xz", None),
    "healthy-seed1": ("h100-2026-12-07c-wide35b-healthy-seed1-served.json.xz", None),
    "engine-bug": ("h100-2026-12-07c-wide35b-engine-bug-served.json.xz", "peft"),
    "healthy-seed2": ("h100-2026-12-07d-wide35b-healthy-seed2-served.json.xz", None),
    "healthy-seed3": ("h100-2026-12-07d-wide35b-healthy-seed3-served.json.xz", None),
    "healthy-seed4": ("h100-2026-12-07e-wide35b-healthy-seed4-served.json.xz", None),
}
HEALTHY = ["healthy", "healthy-seed1", "healthy-seed2", "healthy-seed3", "healthy-seed4"]
SERVED = {run: load(DATA / name) for run, (name, _) in RUNS.items()}
REPORTS = {
    **json.loads((DATA / "h100-2026-12-07c-wide35b-reports.json").read_text()),
    **json.loads((DATA / "h100-2026-12-07d-wide35b-reports.json").read_text()),
}
ENGINE_SIDE = [
    "LoRA scale doubled in vLLM",
    "first LoRA layer skipped in vLLM",
    "another adapter's weights in its slot",
    "experts' down_proj LoRA dropped in vLLM",
]


def controls() -> dict[str, list[Control]]:
    """The run's controls as run_model built them for a0 on a model with routed experts."""
    adapter_side = [Control("a0", HALF, Path("/c")), Control("a0", NO_EXPERTS, Path("/c")),
                    Control("a0", IGNORED, None)]  # fmt: skip
    return {"a0": adapter_side + adaptercontrols.engine_controls("a0", Path("/a0"), 256)}


def judge(served: dict, asked: str | None):
    """As run_model judges, with the run's seven controls (verify_helpers.judge_wide)."""
    return judge_wide(served, controls()["a0"], asked)


def judged(run: str):
    return judge(SERVED[run], RUNS[run][1])


# What the rule changed since the sitting, each on purpose: against PEFT on a MoE one token
# may pass the max bound up to the ceiling, and the row names the next token too
# (rule.MOE_LONE_TOKENS); a stretch past PASS_EXCESS is named (rule.STRETCH_TOKENS).
NEXT_TOKEN = re.compile(
    r"max (\d+\.\d+), the next \d+\.\d+ \(<= ([\d.]+); one token up to [\d.]+\)"
)
STRETCH = re.compile(r", its worst \d+-token stretch \d+\.\d+x \(failed from [\d.]+x\)")
# ...and an open row says what kept it open: the H100 said "short of 2.2x and of every
# control" also of a row whose median was inside and whose worst token alone was out.
OPEN_BY_A_TOKEN = re.compile(
    r": its worst token past the max bound \([\d.]+\), which alone never fails"
)
OPEN_THEN = ": outside the bound, short of 2.2x and of every control this run rejects"
# ...and what would decide a verdict open by tokens alone is other prompts that pass it:
# the H100 said other prompts "where its answers fall on one side of the band"
DECIDES_TOKENS = Code.VERIFY_DECIDES_TOKENS
DECIDES_THEN = (
    "  what decides instead: the same check on other prompts (another --seed) or longer ones "
    "(a larger --max-model-len), where its answers fall on one side of the band; a control "
    "this run could not reject, only a stronger adapter"
)


def as_the_h100_printed_it(text: str) -> str:
    """A line the rule prints now, without what it added since the sitting."""
    return NEXT_TOKEN.sub(r"max \1 (<= \2)", STRETCH.sub("", text))


@pytest.mark.parametrize("run", [run for run in REPORTS if run != "healthy-seed2"])
def test_the_recorded_report_is_what_the_rule_says_of_its_answers(run):
    """Every model-check row (name, result, detail) and every verdict line the H100 printed,
    rebuilt here from the served answers alone: a change to the rule that moves any
    number or word of these reports fails here, with the row it moved. The two changes
    added since (NEXT_TOKEN, STRETCH) are the only ones allowed."""
    result = judged(run)
    recorded = REPORTS[run]
    rows = [c for c in result.checks if not c.name.startswith("adapter check")]
    table = [as_the_h100_printed_it(line) for line in check_table("model check", rows)[1:]]
    wanted = [r for r in recorded["rows"] if not r[0].startswith("adapter check")]
    assert len(table) == len(wanted)
    for line, (name, result_word, detail) in zip(table, wanted, strict=True):
        assert line.split() == f"{name} {result_word} {detail}".split(), name
    lines = [as_the_h100_printed_it(line) for line in adapter_verdict_lines(result.adapters)]
    assert lines == recorded["verdict"][:-1]


@pytest.mark.parametrize("run", HEALTHY)
def test_the_healthy_adapter_passes_with_every_engine_side_control_failed(run):
    result = judged(run)
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("PASSED", "peft"), words(verdict.why)
    assert set(ENGINE_SIDE) <= set(verdict.caught)
    assert len(verdict.caught) == len(controls()["a0"]) == 7
    for check in result.checks:
        if " control " in check.name and "in vLLM" in check.name or "slot" in check.name:
            assert check.ok and "failed from 2.2x" in check.detail, check.name
            ratio = float(check.detail.split("x vLLM's own base error")[0].rsplit(", ", 1)[1])
            assert ratio >= rule.FAIL_EXCESS, (check.name, ratio)


def test_the_injected_engine_bug_is_failed_never_attributed_to_noise():
    """The bug the rule was not tuned on: FAILED on every prompt of both engines, by the
    excess alone (2.40-3.17x against 2.2x), and nothing in the report says noise."""
    result = judged("engine-bug")
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED"), words(verdict.why)
    rows = [c for c in result.checks if c.name.endswith(" tokens vs peft")]
    assert len(rows) == 6 and all(c.failed and c.decided for c in rows)
    ratios = [e.ratio for e in excesses(SERVED["engine-bug"], "", "peft", "lora:a0", "a0")]
    assert min(ratios) >= rule.FAIL_EXCESS, ratios
    assert round(min(ratios), 2) == 2.40 and round(max(ratios), 2) == 3.17
    said = " ".join(adapter_verdict_lines(result.adapters))
    assert "noise" not in said and "not a failure of vLLM" not in said


@pytest.mark.parametrize("fault", ENGINE_SIDE)
def test_an_engine_side_control_that_caught_nothing_takes_the_pass_away(fault):
    """PASSED requires each engine-side control FAILED: the healthy run with one of them
    served as the adapter itself (a fault that changed nothing) is not PASSED, and the
    report names that control as one it could not tell apart."""
    served = copy.deepcopy(SERVED["healthy"])
    kind = next(c.kind for c in controls()["a0"] if c.what == fault)
    for mode in ("eager", "cudagraph"):
        runs = served[mode]["runs"]
        runs[f"control:a0{adaptercontrols.SEP}{kind}"] = copy.deepcopy(runs["lora:a0"])
    [verdict] = judge(served, None).adapters
    assert verdict.verdict == "INCONCLUSIVE", words(verdict.why)
    assert fault not in verdict.caught
    lines = adapter_verdict_lines([verdict])
    assert any(line.startswith(f"  could not tell apart: {fault}") for line in lines), lines


def test_the_healthy_margin_and_the_false_failed_count_over_these_runs():
    """The margin, as measured: the largest healthy excess is 70 % of the PASSED bound at
    seed 11, 76 % at seed 1, 73 % at seed 2, 72 % at seed 3 and 70 % at seed 4; none of
    the 30 healthy samples is FAILED or in the band (false FAILED: 0 of 30 here; with the
    14 of 2026-12-01, 0 of 44, of them 43 distinct: the H200's eager answers to the 600-token
    prompt are these at seed 11, bit for bit, the same model, adapter and prompt). Their
    worst stretch (rule.STRETCH_TOKENS) stands at 71 % of the failure line at most."""
    found = {
        run: [e.ratio for e in excesses(SERVED[run], "", "peft", "lora:a0", "a0")]
        for run in HEALTHY
    }
    assert [len(v) for v in found.values()] == [6, 6, 6, 6, 6]
    shares = [round(max(found[run]) / rule.PASS_EXCESS, 2) for run in HEALTHY]
    assert shares == [0.70, 0.76, 0.73, 0.72, 0.70]
    assert max(max(v) for v in found.values()) <= rule.PASS_EXCESS
    stretches = [stretch(SERVED[run], mode, prompt) for run in HEALTHY for mode, prompt in
                 samples(SERVED[run])]  # fmt: skip
    assert len(stretches) == 30 and round(max(stretches) / rule.FAIL_EXCESS, 2) == 0.71
    h200 = load(DATA / "h200-2026-12-01i-wide35b-served.json.xz")
    same = [
        (mode, prompt)
        for mode, prompt in samples(h200)
        if all(errors(h200, mode, label, prompt) == errors(SERVED["healthy"], mode, label, prompt)
               for label in ("base", "lora:a0"))
    ]  # fmt: skip
    assert same == [("eager", "p600")]


def test_the_healthy_stretches_at_other_prompt_lengths_stand_short_of_the_line():
    """The three recorded lengths fix where the stretches fall; a --max-model-len gives
    the longest prompt any length. The prompts are random tokens and each log-probability
    reads only the tokens before it, so a healthy answer's first L log-probabilities stand
    for a prompt of L + 1 tokens (up to the kernels' rounding, which moves with the batch
    shape). Cut so, every 16 tokens from 1024, the 28 answers of 2999 log-probabilities and
    more (the wide cut at five H100 seeds and on the H200, the tiny MoE's two adapters)
    put their worst stretch at 0.81 of the failure line; at every length of the worst one
    (seed 2, eager, 4096 tokens) at 0.82 (1.80x, cut at 3313), where the recorded lengths
    put 0.71 at most. None is past the line."""
    h200 = load(DATA / "h200-2026-12-01i-wide35b-served.json.xz")
    wide = [(run, SERVED[run]) for run in HEALTHY] + [("h200", h200)]
    answers = [
        (errors(served, mode, "lora:a0", prompt), errors(served, mode, "base", prompt), run)
        for run, served in wide
        for mode, prompt in samples(served)
        if prompt != "p600"
    ]
    tiny = load(DATA / "h200-2026-12-01i-e2e-moe-served.json.xz")
    answers += [
        (errors(tiny, mode, label, "p3000", "moe-"), errors(tiny, mode, "base", "p3000", "moe-"),
         "tiny")
        for mode in ("eager", "cudagraph")
        for label in ("lora:down", "lora:gate_up")
    ]  # fmt: skip
    assert len(answers) == 28

    def worst(mine, base, lengths, seen):
        found = 0.0
        for length in lengths:
            for lo, hi in rule.stretches(length):
                if (lo, hi) not in seen:
                    seen[lo, hi] = rule.stretch_excess(mine[lo:hi], base[lo:hi])
                found = max(found, seen[lo, hi])
        return found

    every_16 = [worst(m, b, range(1024, len(m) + 1, 16), {}) for m, b, _ in answers]
    assert round(max(every_16) / rule.FAIL_EXCESS, 2) == 0.81
    mine, base, run = answers[every_16.index(max(every_16))][:3]
    assert (run, len(mine)) == ("healthy-seed2", 4095)
    every = worst(mine, base, range(1024, len(mine) + 1), {})
    assert round(every, 2) == 1.80 and round(every / rule.FAIL_EXCESS, 2) == 0.82


def samples(served: dict) -> list[tuple[str, str]]:
    """(LoRA engine, prompt) of a recorded run."""
    return [
        (mode, prompt) for mode in ("eager", "cudagraph") for prompt in served[mode]["runs"]["base"]
    ]


def errors(served: dict, mode: str, label: str, prompt: str, prefix: str = "") -> list[float]:
    """|vLLM - PEFT| per token of ``label``'s answer (base against PEFT's base, a control
    against PEFT's a0); ``prefix``: the engines' (the tiny MoE's "moe-")."""
    theirs = label if label == "base" or label.startswith("lora:") else "lora:a0"
    peft = served[prefix + engines.PEFT_ENTRY]["runs"][theirs]
    ours = served[prefix + mode]["runs"][label][prompt]["prompt_logprobs"]
    return [abs(x - y) for x, y in zip(ours, peft[prompt]["prompt_logprobs"], strict=True)]


def stretch(served: dict, mode: str, prompt: str, label: str = "lora:a0") -> float:
    """rule.stretch_excess of ``label`` on one prompt of one engine."""
    base = errors(served, mode, "base", prompt)
    return rule.stretch_excess(errors(served, mode, label, prompt), base)


def test_seed_2_was_inconclusive_on_one_worst_token_and_passes_by_the_rule_now(monkeypatch):
    """The H100 printed INCONCLUSIVE at seed 2: on the 4096-token prompt the adapter's
    worst token, 3.854 and 3.815 nats, lay past 1.5 x the engine's own worst over the
    prompts (bounds 3.159 and 3.76), its median excess 1.29-1.32x (<= 1.8x) and every
    control FAILED. With no lone token allowed, as the H100 ran, the replay prints that
    report word for word but the open rows' reason, worded now by what kept them open
    (OPEN_BY_A_TOKEN), and what would decide (DECIDES_TOKENS); under the rule now only
    those two rows change, to inside (the next token under the bound), and the adapter
    PASSES with all seven controls caught."""
    monkeypatch.setattr(references, "MOE_LONE_TOKENS", 0)
    recorded = REPORTS["healthy-seed2"]
    then = judged("healthy-seed2")
    rows = [OPEN_BY_A_TOKEN.sub(OPEN_THEN, " ".join(row)).split() for row in report_rows(then)]
    assert rows == [f"{n} {w} {d}".split() for n, w, d in recorded["rows"][1:]]
    lines = [OPEN_BY_A_TOKEN.sub(OPEN_THEN, line) for line in adapter_verdict_lines(then.adapters)]
    decides = [i for i, line in enumerate(lines) if line.startswith("  what decides instead:")]
    assert decides == [3] and then.adapters[0].decides_instead.code == DECIDES_TOKENS
    assert lines[:3] + [DECIDES_THEN] + lines[4:] == recorded["verdict"][:-1]
    monkeypatch.undo()
    now = judged("healthy-seed2")
    [verdict] = now.adapters
    assert (verdict.verdict, len(verdict.caught)) == ("PASSED", 7), words(verdict.why)
    printed = [f"{n} {w} {d}".split() for n, w, d in recorded["rows"][1:]]
    rows = [as_the_h100_printed_it(" ".join(row)).split() for row in report_rows(now)]
    moved = [a[0:3] for a, b in zip(rows, printed, strict=True) if a != b]
    assert moved == [["eager:", "a0", "4096"], ["cudagraph:", "a0", "4096"]]
    assert [r[1] for r in recorded["rows"] if " a0 4096 tokens vs peft" in r[0]] == [
        "undecided"
    ] * 2


def test_a_verdict_open_by_tokens_alone_says_no_other_prompt_fails_it(monkeypatch):
    """Seed 2 as the H100 judged it (no lone token): open by its worst token alone on the
    4096-token prompt, its median 1.29-1.32x. What would decide said "other prompts ...
    where its answers fall on one side of the band": its answers were on one side (inside),
    and no prompt fails a token. It says what other prompts can decide (PASSED), and that
    tokens past the bound at every seed leave it open; under the rule now (one lone token),
    with a second token of that prompt put 4 nats off, it names the lone token too."""
    monkeypatch.setattr(references, "MOE_LONE_TOKENS", 0)
    [verdict] = judged("healthy-seed2").adapters
    assert verdict.verdict == "INCONCLUSIVE" and verdict.decides_instead.code == DECIDES_TOKENS
    assert words(verdict.decides_instead) == (
        "the same check on other prompts (another --seed), where no token lies past the max "
        "bound: it passes there; a token alone never fails, so tokens past the bound at "
        "every seed leave it open"
    )
    monkeypatch.undo()
    served = copy.deepcopy(SERVED["healthy-seed2"])
    for mode in ("eager", "cudagraph"):
        served[mode]["runs"]["lora:a0"]["p4096"]["prompt_logprobs"][2000] -= 4.0
    [verdict] = judge(served, None).adapters
    assert verdict.verdict == "INCONCLUSIVE" and verdict.decides_instead.code == DECIDES_TOKENS
    assert "where at most one token lies past the max bound, none past the 6.0-nat ceiling: " in (
        words(verdict.decides_instead)
    )


def report_rows(result) -> list[list[str]]:
    """The model-check rows but the adapter check, as the report prints them, split."""
    rows = [c for c in result.checks if not c.name.startswith("adapter check")]
    return [line.split() for line in check_table("model check", rows)[1:]]


@pytest.mark.parametrize("fault", ["engine-layer-skipped", "engine-experts-down-dropped", "half"])
def test_a_wrong_lora_path_on_the_last_tenth_of_a_prompt_is_failed(fault, monkeypatch):
    """A bug that breaks a region of a prompt (a chunk, the positions past some length):
    the healthy adapter's answers with a control's on the last 10 % of the 4096-token
    prompt's positions, in both engines. The prompt's median barely moves (1.36-1.39x);
    its worst stretch stands past the failure line (2.32-2.72x), so the adapter is
    FAILED, the stretch named. The worst-token bound the rule had before (1.5 x the
    engine's own worst, 4.2-4.7 nats here) passed it: its worst token was 2.78-3.55."""
    served = copy.deepcopy(SERVED["healthy"])
    for mode in ("eager", "cudagraph"):
        runs = served[mode]["runs"]
        prompt = max(runs["base"], key=lambda p: len(runs["base"][p]["prompt_logprobs"]))
        mine = runs["lora:a0"][prompt]["prompt_logprobs"]
        wrong = runs[f"control:a0{adaptercontrols.SEP}{fault}"][prompt]["prompt_logprobs"]
        cut = len(mine) - len(mine) // 10
        runs["lora:a0"][prompt]["prompt_logprobs"] = mine[:cut] + wrong[cut:]
    [verdict] = judge(served, None).adapters
    assert verdict.verdict == "FAILED", words(verdict.why)
    assert "4096 tokens vs peft" in words(verdict.why) and "-token stretch" in words(verdict.why)
    monkeypatch.setattr(references, "MOE_LONE_TOKENS", 0)
    monkeypatch.setattr(rule, "STRETCH_TOKENS", 1 << 30)  # one stretch: the prompt's median
    assert judge(served, None).adapters[0].verdict == "PASSED"


SERVED_CONTROLS = [c.kind for c in controls()["a0"] if c.kind != IGNORED]


def spliced(run: str, kind: str, positions) -> dict:
    """The recorded run with control ``kind``'s answers at ``positions`` (a function of the
    prompt's length) of the 4096-token prompt, in both engines: a wrong LoRA path there."""
    served = copy.deepcopy(SERVED[run])
    for mode in ("eager", "cudagraph"):
        runs = served[mode]["runs"]
        mine = runs["lora:a0"]["p4096"]["prompt_logprobs"]
        wrong = runs[f"control:a0{adaptercontrols.SEP}{kind}"]["p4096"]["prompt_logprobs"]
        for i in positions(len(mine)):
            mine[i] = wrong[i]
    return served


def last_tenth(n: int) -> range:
    return range(n - n // 10, n)


def test_the_last_tenth_wrong_puts_a_stretch_past_the_line_at_every_seed_for_every_control(
    monkeypatch,
):
    """The case above at all five seeds, with each of the six controls served: its worst
    stretch stands at 2.29-3.53x (30 x 2 engines), never under the failure line, while
    the prompt's median says 1.31-1.46x, and the adapter is always FAILED. The rule before
    the stretches (no stretch, no lone token) passed 18 of the 24 at seeds 11, 1,
    3 and 4 (at seed 2 the healthy adapter itself was outside its worst-token bound)."""
    found, ratios, old_passed = [], [], 0
    for run in HEALTHY:
        for kind in SERVED_CONTROLS:
            served = spliced(run, kind, last_tenth)
            for mode in ("eager", "cudagraph"):
                mine, base = (errors(served, mode, label, "p4096") for label in ("lora:a0", "base"))
                ratios.append(statistics.median(mine) / statistics.median(base))
                found.append(rule.stretch_excess(mine, base))
            assert judge(served, None).adapters[0].verdict == "FAILED", (run, kind)
            with monkeypatch.context() as before:
                before.setattr(references, "MOE_LONE_TOKENS", 0)
                before.setattr(rule, "STRETCH_TOKENS", 1 << 30)
                old_passed += judge(served, None).adapters[0].verdict == "PASSED"
    assert len(found) == 60 and min(found) >= rule.FAIL_EXCESS
    assert (round(min(found), 2), round(max(found), 2)) == (2.29, 3.53)
    assert (round(min(ratios), 2), round(max(ratios), 2)) == (1.31, 1.46)
    assert old_passed == 18


def test_a_control_caught_by_a_stretch_alone_is_caught_at_the_stretchs_excess():
    """The 50 %-strength control served as a fault that takes on the last 10 % of the
    4096-token prompt only (the adapter's own answers elsewhere): caught by that prompt's
    worst stretch, its median short of the line. Its value is the excess that caught it,
    past 2.2x (2.37x): it was the prompt's median (1.38x), so the report read "the nearest it
    caught: 50 % strength (1.38x vLLM's own base error)" under "every control past the
    failure line (2.2x)"."""
    served = copy.deepcopy(SERVED["healthy"])
    for mode in ("eager", "cudagraph"):
        runs = served[mode]["runs"]
        half = runs[f"control:a0{adaptercontrols.SEP}{HALF}"]
        control = copy.deepcopy(runs["lora:a0"])
        answer = control["p4096"]["prompt_logprobs"]
        for i in last_tenth(len(answer)):
            answer[i] = half["p4096"]["prompt_logprobs"][i]
        runs[f"control:a0{adaptercontrols.SEP}{HALF}"] = control
    result = judge(served, None)
    [verdict] = result.adapters
    assert (verdict.verdict, len(verdict.caught)) == ("PASSED", 7), words(verdict.why)
    [half] = [c for c in verdict.controls if c.what == "50 % strength"]
    assert half.value >= rule.FAIL_EXCESS and "-token stretch" in half.detail, half
    lines = adapter_verdict_lines(result.adapters)
    assert "  the nearest it caught: 50 % strength (2.37x vLLM's own base error)" in lines


@pytest.mark.parametrize("kind", SERVED_CONTROLS)
def test_a_broken_region_is_seen_inside_a_stretch_and_astride_two(kind, monkeypatch):
    """576 wrong tokens inside the second stretch of the 4096-token prompt (585 tokens
    each) make the adapter FAILED, and so do the same 576 across the border of the
    second and third (288 in each): the stretches overlap by half, so that region is
    most of the one between. With stretches side by side (none between) it passed."""
    size = round(4095 / (4095 // rule.STRETCH_TOKENS))
    inside = spliced("healthy", kind, lambda n: range(size, size + 576))
    astride = spliced("healthy", kind, lambda n: range(2 * size - 288, 2 * size + 288))
    assert judge(inside, None).adapters[0].verdict == "FAILED"
    assert judge(astride, None).adapters[0].verdict == "FAILED"

    def side_by_side(length):  # the stretches, none overlapping
        count = max(1, length // rule.STRETCH_TOKENS)
        cuts = [round(i * length / count) for i in range(count + 1)]
        return list(zip(cuts, cuts[1:], strict=False))

    monkeypatch.setattr(rule, "stretches", side_by_side)
    assert judge(astride, None).adapters[0].verdict == "PASSED"


def test_a_wrong_path_on_a_scattered_quarter_of_the_positions_passes(monkeypatch):
    """A wrong path on a quarter of the 4096-token prompt's positions, scattered (a bug
    that breaks some tokens, not a region): the prompt's median moves to 1.54-1.61x and
    its worst stretch to 1.67-1.84x, short of both lines, and every control's answers so
    spliced PASS. The worst-token bound the rule had before caught the doubled scale
    there, by one token 4.53 nats off (its bound 4.199), which one lone token allowed
    (rule.MOE_LONE_TOKENS) passes: the next token was under it."""
    quarter = sorted(random.Random(0).sample(range(4095), 4095 // 4))
    ratios, stretches = [], []
    for kind in SERVED_CONTROLS:
        served = spliced("healthy", kind, lambda n: quarter)
        assert judge(served, None).adapters[0].verdict == "PASSED", kind
        for mode in ("eager", "cudagraph"):
            mine, base = (errors(served, mode, label, "p4096") for label in ("lora:a0", "base"))
            ratios.append(statistics.median(mine) / statistics.median(base))
            stretches.append(rule.stretch_excess(mine, base))
    assert (round(min(ratios), 2), round(max(ratios), 2)) == (1.54, 1.61)
    assert (round(min(stretches), 2), round(max(stretches), 2)) == (1.67, 1.84)
    served = spliced("healthy", "engine-scale-2", lambda n: quarter)
    monkeypatch.setattr(references, "MOE_LONE_TOKENS", 0)
    result = judge(served, None)
    assert result.adapters[0].verdict == "INCONCLUSIVE"
    [row] = [c for c in result.checks if c.name == "eager: a0 4096 tokens vs peft"]
    assert "max 4.528 (<= 4.199)" in row.detail, row.detail


def test_engines_that_did_not_start_are_failed_and_no_reference_is_said_to_have_decided():
    """The sitting's first try at seed 1 ran without the bundle's import shims: every
    engine exited 1 at import (ModuleNotFoundError: xgrammar). verify said FAILED, as a
    vLLM that does not start is, but its reference line read "merged (it decided, its own
    bf16 rounding unknown ...)" of a reference that never ran, and the table ran
    "undecided" into its detail ("undecidedvLLM")."""
    error = "exited 1: ModuleNotFoundError: No module named 'xgrammar'"
    served = {
        name: {"error": f"vLLM ({name}) {error}"}
        for name in SERVED["healthy"]
        if name != engines.PEFT_ENTRY
    }
    chosen, need = usermodel.choose_references(served, ["a0"], controls(), None)
    assert need == []  # the verdict is decided without any reference: no PEFT to run
    result = usermodel.judge(served, ["a0"], controls(), chosen)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED"), words(verdict.why)
    assert "vLLM ran" in words(verdict.why)
    said = words(verdict.reference_why)
    assert said.startswith("the merged reference did not run (vLLM (merged-a0) exited 1")
    assert "decided" not in said
    table = check_table("model check", result.checks)
    undecided = [line for line in table if " undecided " in line]
    assert undecided and all("undecided vLLM (" in line for line in undecided), table


def test_a_control_whose_fault_took_no_effect_is_not_served_and_takes_the_pass_away():
    """The serving child marks a control whose fault changed no tensor as not served
    (serving._faults_applied): the healthy run with one so marked is INCONCLUSIVE, the
    control named with the engine's reason, never counted as caught."""
    served = copy.deepcopy(SERVED["healthy"])
    why = (
        "its engine-side fault (layer-skipped) changed no tensor in worker 0 of 1: "
        "not the control it stands for"
    )
    for mode in ("eager", "cudagraph"):
        served[mode]["runs"]["control:a0+engine-layer-skipped"] = {"error": why}
    result = judge(served, None)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("INCONCLUSIVE", "INCONCLUSIVE")
    assert "first LoRA layer skipped in vLLM" not in verdict.caught
    rows = [c for c in result.checks if "first LoRA layer skipped" in c.name]
    assert len(rows) == 2 and all(not c.served and c.detail == f"not served: {why}" for c in rows)


def near_the_adapter(served: dict, how: str) -> None:
    """The layer-skipped control served as a fault that took but moved little: the
    adapter's own answers (``same``), or half way from them to the merged reference
    (``nearer``: a control nearer the reference than the adapter)."""
    merged = served["merged-a0"]["runs"]["merged"]
    for mode in ("eager", "cudagraph"):
        runs = served[mode]["runs"]
        control = copy.deepcopy(runs["lora:a0"])
        if how == "nearer":
            for prompt, one in control.items():
                wanted = merged[prompt]["prompt_logprobs"]
                one["prompt_logprobs"] = [
                    (a + b) / 2 for a, b in zip(one["prompt_logprobs"], wanted, strict=True)
                ]
        runs["control:a0+engine-layer-skipped"] = control


@pytest.mark.parametrize("how", ["same", "nearer"])
def test_without_its_rounding_control_the_merged_reference_rejects_no_control(how):
    """The healthy run with the rounding control's engine down (OOM): the merged
    reference's precision is unknown and its bound falls to 0.03 mean, which every answer
    of this MoE passes, the adapter's 0.36-0.43 too. A control outside that bound is no
    wrong distance the run has shown: a control near the adapter made the healthy adapter
    FAILED "as far as a control this run rejects" against the merged reference, and PEFT
    was never asked. The merged reference cannot decide; PEFT does, and cannot tell that
    control apart: INCONCLUSIVE, the control named."""
    served = copy.deepcopy(SERVED["healthy"])
    served["rounding-a0"] = {"error": "vLLM (rounding-a0) exited 1: CUDA out of memory"}
    near_the_adapter(served, how)
    result = judge(served, None)
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("INCONCLUSIVE", "peft"), words(verdict.why)
    assert not [c.name for c in result.checks if c.failed]
    assert "first LoRA layer skipped in vLLM" in verdict.missed
    assert not any("as far as a control" in c.detail for c in result.checks)


def test_a_coarse_merged_reference_alone_says_it_caught_no_control():
    """PEFT did not run, so the merged reference (its roundings 0.35-0.41 apart, too coarse
    to call a miss vLLM's) is all the run has. Its bound is no fail line, so no control is
    caught by it ("would have caught" listed all seven), and a control outside it is not
    said to be inside."""
    served = copy.deepcopy(SERVED["healthy"])
    served[engines.PEFT_ENTRY] = {"error": "patchkit.verify.peftref cannot be imported"}
    result = judge(served, None)
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("INCONCLUSIVE", "merged")
    assert verdict.caught == [] and len(verdict.missed) == 7
    rows = [c for c in result.checks if " control " in c.name]
    assert rows and all(not c.ok and not c.decided for c in rows)
    assert not any("inside the bound" in c.detail for c in rows)
    assert all("is not known to be small (mean <= 0.1)" in c.detail for c in rows)


def _spoil(served: dict, where: str, prompt: str, how: str) -> None:
    """One reference answer spoilt: one token NaN or -inf, or the prompt's answer gone."""
    engine, label = {
        "PEFT's LoRA": (engines.PEFT_ENTRY, "lora:a0"),
        "PEFT's base": (engines.PEFT_ENTRY, "base"),
        "the merged reference": ("merged-a0", "merged"),
    }[where]
    group = served[engine]["runs"][label]
    if how == "missing":
        del group[prompt]
    else:
        group[prompt]["prompt_logprobs"][10] = float(how)


@pytest.mark.parametrize(
    "where,how",
    [
        ("PEFT's LoRA", "nan"),
        ("PEFT's LoRA", "-inf"),
        ("PEFT's LoRA", "missing"),
        ("PEFT's base", "nan"),
        ("PEFT's base", "-inf"),
        ("PEFT's base", "missing"),
        ("the merged reference", "nan"),
        ("the merged reference", "missing"),
    ],
)
def test_a_reference_answer_that_cannot_judge_is_no_failure_of_vllm(where, how):
    """vLLM's answers as the healthy run served them; one answer of a reference spoilt (a
    NaN, an -inf, the prompt missing). That read FAILED ("median |d logprob| inf", "smallest
    share 0.00": the reference's NaN charged to vLLM; against the merged reference "as far
    as a control this run rejects (inf)"), or the PEFT row "0.00x vLLM's own base error
    inf" passed whatever vLLM answered, or verify stopped on a KeyError. The prompt the
    reference cannot judge is undecided and says whose answer is missing; nothing is
    FAILED and nothing passes by it."""
    served = copy.deepcopy(SERVED["healthy"])
    _spoil(served, where, "p4096" if how == "missing" else "p600", how)
    result = judge(served, None)
    [verdict] = result.adapters
    assert not [c.name for c in result.checks if c.failed], words(verdict.why)
    assert verdict.verdict in ("INCONCLUSIVE", "PASSED")
    rows = [c for c in result.checks if " tokens vs " in c.name]
    assert not any("inf" in c.detail for c in rows if c.ok)
    if where.startswith("PEFT"):
        assert verdict.verdict == "INCONCLUSIVE" and verdict.reference == "peft"
        open_ = [c for c in rows if not c.ok]
        assert len(open_) == 2 and all(not c.decided for c in open_)
        assert all(f"{where} answer to this prompt" in c.detail for c in open_), open_
        assert all("outside the bound" not in c.detail for c in open_)


def weaker(served: dict, k: float) -> dict:
    """The healthy run as an adapter ``k`` times as strong would have it, served right:
    vLLM's LoRA and PEFT's k of the way from their base answers; each merged reference as
    far from vLLM's LoRA as it was (its bf16 rounding moves every changed weight by up to
    half a step whatever the adapter's size, so it keeps its own noise)."""
    served = copy.deepcopy(served)
    eager = served["eager"]["runs"]
    for prompt, one in eager["lora:a0"].items():
        base = eager["base"][prompt]["prompt_logprobs"]
        delta = [a - b for a, b in zip(one["prompt_logprobs"], base, strict=True)]
        for name in ("merged-a0", "rounding-a0"):
            ref = served[name]["runs"]["merged"][prompt]
            ref["prompt_logprobs"] = [
                x - (1 - k) * d for x, d in zip(ref["prompt_logprobs"], delta, strict=True)
            ]
    for label, runs in [("lora:a0", served[m]["runs"]) for m in ("eager", "cudagraph")] + [
        ("lora:a0", served[engines.PEFT_ENTRY]["runs"])
    ]:
        for prompt, one in runs[label].items():
            base = runs["base"][prompt]["prompt_logprobs"]
            one["prompt_logprobs"] = [
                b + k * (a - b) for a, b in zip(one["prompt_logprobs"], base, strict=True)
            ]
        if "lora_after_long" in runs:
            runs["lora_after_long"]["p600"] = copy.deepcopy(runs[label]["p600"])
    return served


def test_a_weak_adapter_is_not_failed_by_the_merged_references_own_rounding():
    """An adapter a fifth as strong, served right. Its merged reference moves the output
    0.37-0.40 from base, most of it the reference's own bf16 rounding (its two roundings
    0.35-0.41 apart), while vLLM's LoRA moves it 0.18: "smallest share 0.42 (>= 0.5)",
    FAILED against the merged reference and PEFT never asked. Half of an effect the
    reference's own rounding could make up is no proof LoRA is not applied: undecided
    there, and PEFT (float32, no rounding of its own) decides."""
    result = judge(weaker(SERVED["healthy"], 0.2), None)
    [verdict] = result.adapters
    assert verdict.reference == "peft", words(verdict.why)
    effect = [c for c in result.checks if c.name.endswith("adapter differs from base")]
    assert len(effect) == 2 and all(c.ok for c in effect), [c.detail for c in effect]
    assert not [c.name for c in result.checks if c.failed]
    # the merged reference alone (--reference merged): undecided, and its words true of a
    # bound wider than the effect ("an adapter at -65% of its strength could pass")
    result = judge(weaker(SERVED["healthy"], 0.2), "merged")
    [verdict] = result.adapters
    assert verdict.verdict == "INCONCLUSIVE" and not [c for c in result.checks if c.failed]
    effect = [c for c in result.checks if c.name.endswith("adapter differs from base")]
    assert all(not c.ok and not c.decided for c in effect)
    assert all("could make up the rest of its effect" in c.detail for c in effect)
    assert all("an adapter not applied at all could pass" in c.detail for c in effect)


def test_a_reference_that_did_not_run_is_what_would_decide():
    """--reference peft where transformers + PEFT could not run: every row undecided, and
    what would decide was "the same check on other prompts (another --seed) or longer
    ones", which no seed gives; it is the reference running, said with why it did not."""
    served = copy.deepcopy(SERVED["engine-bug"])
    served[engines.PEFT_ENTRY] = {"error": "patchkit.verify.peftref cannot be imported"}
    [verdict] = judge(served, "peft").adapters
    assert (verdict.verdict, verdict.reference) == ("INCONCLUSIVE", "peft")
    said = words(verdict.decides_instead)
    assert "--seed" not in said and "patchkit.verify.peftref cannot be imported" in said


def test_a_nan_in_a_controls_answer_fails_the_run_and_names_the_control():
    """An engine-side control's weights are the adapter's own, finite and of its size, in
    a slot the engine fills as it fills any adapter's: a vLLM that answers NaN to them
    would answer NaN to a user's next adapter in that slot. The run is FAILED by the
    engine's NaN row, which names the control; the adapter's own answers matched, so its
    verdict stays PASSED and says nothing else."""
    served = copy.deepcopy(SERVED["healthy"])
    control = served["eager"]["runs"]["control:a0+engine-scale-2"]
    next(iter(control.values()))["token_logprobs"][3] = float("nan")
    result = judge(served, None)
    failed = [(c.name, c.detail) for c in result.checks if not c.ok and c.decided is not False]
    assert failed == [("eager: no NaN log-probabilities", "1 NaN (in control:a0+engine-scale-2)")]
    assert result.verdict == "FAILED" and result.adapters[0].verdict == "PASSED"


NEXT_SAID = re.compile(r"the next (\d+\.\d+) \(<= (\d+\.\d+);")


def next_token_shares(result) -> list[float]:
    """Each LoRA row's next-to-worst token as a share of its max bound, as printed."""
    rows = [c for c in result.checks if re.fullmatch(r"\w+: a0 \d+ tokens vs peft", c.name)]
    found = [NEXT_SAID.search(c.detail) for c in rows]
    return [float(m.group(1)) / float(m.group(2)) for m in found if m]


def test_no_healthy_answer_puts_a_second_token_past_the_max_bound():
    """One token may pass the max bound on a MoE (rule.MOE_LONE_TOKENS); none of the 36
    healthy samples of the wide cut (five H100 seeds, the H200 run) puts a second one
    past it: the next-to-worst token stands at 0.80 of the bound at most."""
    h200 = judge_wide(load(DATA / "h200-2026-12-01i-wide35b-served.json.xz"))
    shares = [s for run in HEALTHY for s in next_token_shares(judged(run))]
    shares += next_token_shares(h200)
    assert len(shares) == 36 and round(max(shares), 2) == 0.80
