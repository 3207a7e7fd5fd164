"""`verify --model`'s verdicts: PASSED, FAILED or INCONCLUSIVE per adapter, the controls
they rest on, and the reference that judges.

Judged on what vLLM really served (the MoE case of `verify --e2e` on the test H200,
tests/data/h200-2026-11-30h-moe-tp1-served.json.gz) with the controls' answers made
from it, and on synthetic runs; the controls are built from adapters in PEFT's three
expert layouts (the fused ones as PEFT 0.21.2 saved them, tests/data/
peft-0.21.2-moe-one-parameter.pt); the PEFT reference is a stand-in child process
writing a served result (the real one is patchkit.verify.peftref).
"""

from __future__ import annotations

import copy
import gzip
import json
import lzma
import math
import os
import sys
import types
from pathlib import Path

import pytest

import patchkit.verify
from patchkit.cli.commands.verify import verify_request
from patchkit.cli.verify_words import say as words
from patchkit.errors import PatchkitError, UsageProblem
from patchkit.verify import adaptercontrols, engines, references, rule, serving, usermodel
from patchkit.verify.adaptercontrols import HALF, IGNORED, NO_EXPERTS, Control
from tests.verify_helpers import (
    fake_controls,
    fake_served,
    lora,
    merged,
    request,
    shift,
    when_ready,
)

torch = pytest.importorskip("torch", reason="the controls are written with torch")
from tests.checkpoint_helpers import st_read, write_adapter  # noqa: E402

DATA = Path(__file__).parent / "data"


# ----- on the real MoE numbers -----


def recorded_with_controls() -> dict:
    """The TP=1 MoE run, each LoRA engine given the answers of the adapter's half-strength
    control (half way between base and LoRA, as the existing half-strength test makes it)."""
    with gzip.open(DATA / "h200-2026-11-30h-moe-tp1-served.json.gz", "rt") as handle:
        served = json.load(handle)
    for mode in ("moe-eager", "moe-cudagraph"):
        runs = served[mode]["runs"]
        half = copy.deepcopy(runs["lora:moe"])
        for prompt, one in half.items():
            base = runs["base"][prompt]["prompt_logprobs"]
            one["prompt_logprobs"] = [
                (a + b) / 2 for a, b in zip(one["prompt_logprobs"], base, strict=True)
            ]
        runs["control:moe+half"] = half
    return served


MOE_CONTROLS = {
    "moe": [Control("moe", HALF, Path("/c")), Control("moe", NO_EXPERTS, None),
            Control("moe", IGNORED, None)]
}  # fmt: skip


def judge_recorded(served) -> rule.ModelResult:
    return usermodel.judge(served, ["moe"], MOE_CONTROLS, merged(served, ["moe"], "moe-"), "moe-")


def test_the_real_moe_run_passes_and_rejects_every_control():
    result = judge_recorded(recorded_with_controls())
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("PASSED", "PASSED"), words(verdict.why)
    assert verdict.caught == ["50 % strength", "experts ignored", "adapter ignored"]
    assert verdict.missed == [] and verdict.reference == "merged"


def test_a_reference_as_coarse_as_the_wide_moe_one_is_inconclusive_not_failed():
    """The 35B-A3B-wide MoE on the H200: the merged reference's two roundings 0.43-0.46
    apart (routing flips), LoRA's max 2.1-3.5 past the 2-nat ceiling, on a healthy
    setup. That read `verify FAILED`; it is the reference that cannot judge."""
    served = recorded_with_controls()
    shift(served["moe-rounding-moe"]["runs"]["merged"], 0.44)
    reference = served["moe-merged-moe"]["runs"]["merged"]["p3000"]["prompt_logprobs"]
    for mode in ("moe-eager", "moe-cudagraph"):
        served[mode]["runs"]["lora:moe"]["p3000"]["prompt_logprobs"][7] = reference[7] - 2.6
    result = judge_recorded(served)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("INCONCLUSIVE", "INCONCLUSIVE")
    assert not [c.name for c in result.checks if c.failed]
    assert "its own bf16 rounding" in words(verdict.why) and "too coarse" in words(verdict.why)
    assert "--reference peft" in words(verdict.decides_instead)
    rows = {c.name: c for c in result.checks}
    row = rows["moe-eager: moe 3000 tokens vs merged"]
    assert not row.ok and not row.decided and "too coarse to call it vLLM's" in row.detail


def test_against_a_coarse_merged_reference_a_control_out_by_one_token_is_no_witness():
    """The reference as coarse as above (its roundings 0.44 apart: a miss alone is not
    called vLLM's), and the adapter silently not applied (the base model's answers in
    its place, as its adapter-ignored control is judged). Its mean, 0.60-0.62, is inside
    the widened bound (0.6675); only its worst token is out. A control caught by one
    token is no measure of a wrong distance (a control that changed nothing would be
    caught the same way wherever the adapter is): the rows are undecided, never "as far
    as a control", and the run is FAILED by what does decide it, the adapter's effect."""
    served = recorded_with_controls()
    shift(served["moe-rounding-moe"]["runs"]["merged"], 0.44)
    for mode in ("moe-eager", "moe-cudagraph"):
        runs = served[mode]["runs"]
        runs["lora:moe"] = copy.deepcopy(runs["base"])
    result = judge_recorded(served)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED"), words(verdict.why)
    assert "adapter differs from base" in words(verdict.why)
    rows = [c for c in result.checks if " tokens vs merged" in c.name]
    assert rows and all(not c.ok and not c.decided for c in rows)
    assert not any("as far as a control" in c.detail for c in rows)
    ignored = [c for c in result.checks if "control adapter ignored" in c.name]
    assert ignored and all("cannot tell it apart" in c.detail for c in ignored)


WIDE_CONTROLS = {
    "a0": [Control("a0", HALF, Path("/c")), Control("a0", NO_EXPERTS, Path("/c")),
           Control("a0", IGNORED, None)]
}  # fmt: skip


def judge_wide35b() -> rule.ModelResult:
    """`verify --model` of the healthy rank-16 adapter on the 35B-A3B-wide cut as the H200
    served it (tests/data/h200-2026-12-01i-wide35b-served.json.xz: vLLM 0.26.0 with the
    default set; every engine, the controls and transformers + PEFT in float32), judged
    as run_model judges: the merged reference first, then PEFT where it cannot decide."""
    with lzma.open(DATA / "h200-2026-12-01i-wide35b-served.json.xz", "rt") as handle:
        served = json.load(handle)
    peft = served.pop(engines.PEFT_ENTRY)
    chosen, need = usermodel.choose_references(served, ["a0"], WIDE_CONTROLS, None)
    assert need == ["a0"], "the merged reference decided on the wide MoE"
    served[engines.PEFT_ENTRY] = peft
    run = engines.Served.from_json(served, ["a0"])
    chosen["a0"] = references.peft_or_merged(run, "a0", chosen["a0"])
    return usermodel.judge(served, ["a0"], WIDE_CONTROLS, chosen)


def test_the_wide_moe_healthy_adapter_passes_against_peft_and_rejects_every_control():
    result = judge_wide35b()
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("PASSED", "PASSED"), words(verdict.why)
    assert verdict.reference == "peft" and "could not decide" in words(verdict.reference_why)
    assert verdict.caught == ["50 % strength", "experts ignored", "adapter ignored"]
    rows = {c.name: c for c in result.checks}
    detail = rows["eager: a0 4096 tokens vs peft"].detail
    assert "max 2.660, the next 2.538 (<= 4.199; one token up to 6.0)" in detail


def test_the_wide_moe_run_was_inconclusive_under_the_old_two_nat_ceiling(monkeypatch):
    """The same numbers with the PEFT max bound capped at 2 nats, as when the H200 first
    served this: single tokens 1.85-2.69 off, inside vLLM's own 2.80-3.11 against float32."""
    monkeypatch.setattr(rule, "PEFT_MAX_CEILING", 2.0)
    [verdict] = judge_wide35b().adapters
    assert verdict.verdict == "INCONCLUSIVE"


def test_a_mean_four_times_the_references_own_is_failed_though_one_token_of_it_flips():
    """The reference's two roundings 0.031-0.040 mean apart, and one token of the 3000
    moved 1.45 nats by a flipped routing choice (as on the H200's tiny MoE): 1.5 x 1.45
    is past the 2-nat ceiling, so a miss of the worst token cannot be called vLLM's. The
    adapter served at 75 % of its strength misses by the mean, 0.16 against a bound of
    0.061: that read "this reference's own bf16 rounding (mean 0.0405, max 1.450) is too
    coarse to call it vLLM's", INCONCLUSIVE, of a mean four times that rounding's. The
    ceiling cuts the max bound only; the mean decides: FAILED."""
    served = recorded_with_controls()
    merged_p3000 = served["moe-merged-moe"]["runs"]["merged"]["p3000"]["prompt_logprobs"]
    rounding = served["moe-rounding-moe"]["runs"]["merged"]["p3000"]["prompt_logprobs"]
    rounding[100] = merged_p3000[100] - 1.45
    for mode in ("moe-eager", "moe-cudagraph"):
        runs = served[mode]["runs"]
        for prompt, one in runs["lora:moe"].items():
            base = runs["base"][prompt]["prompt_logprobs"]
            one["prompt_logprobs"] = [
                0.75 * a + 0.25 * b for a, b in zip(one["prompt_logprobs"], base, strict=True)
            ]
        runs["lora_after_long"]["p600"] = copy.deepcopy(runs["lora:moe"]["p600"])
    result = judge_recorded(served)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED"), words(verdict.why)
    rows = [c for c in result.checks if " tokens vs merged" in c.name]
    assert len(rows) == 4 and all(c.failed for c in rows)
    assert not any("too coarse" in c.detail for c in rows)
    means = [float(c.detail.split("mean |d logprob| ")[1].split()[0]) for c in rows]
    assert min(means) > 0.15 and "(<= 0.0607)" in rows[0].detail


def test_a_poisoned_adapter_fails_even_against_a_coarse_reference():
    served = recorded_with_controls()
    shift(served["moe-rounding-moe"]["runs"]["merged"], 0.44)
    served["moe-cudagraph"]["runs"]["lora:moe"]["p3000"]["prompt_logprobs"][5] = math.nan
    result = judge_recorded(served)
    [verdict] = result.adapters
    assert (verdict.verdict, result.verdict) == ("FAILED", "FAILED")
    assert words(verdict.why).startswith("moe-cudagraph: moe answers: finite, no run of token id 0")


def test_a_poisoned_adapter_fails_alone_and_its_neighbour_still_passes():
    """One engine serves both: the NaN rows are the poisoned adapter's, so it fails
    and the run fails, while the healthy adapter keeps its own verdict."""
    served = fake_served(["one", "poisoned"])
    for mode in serving.MODES:
        lora(served, mode, "poisoned")["p600"]["prompt_logprobs"][3] = math.inf
        served[mode]["corrupted_requests"] = 1
    names = ["one", "poisoned"]
    result = usermodel.judge(served, names, fake_controls(names), merged(served, names))
    assert [a.verdict for a in result.adapters] == ["PASSED", "FAILED"]
    assert result.verdict == "FAILED"


def test_a_control_not_served_leaves_the_adapter_inconclusive():
    served = fake_served(["one"])
    served["eager"]["runs"]["control:one+half"] = {"error": "ValueError: no room"}
    result = usermodel.judge(served, ["one"], fake_controls(["one"]), merged(served, ["one"]))
    [verdict] = result.adapters
    assert verdict.verdict == "INCONCLUSIVE"
    assert [(c.what, c.rejected) for c in verdict.controls] == [
        ("50 % strength", None),
        ("adapter ignored", True),
    ]


def test_an_engine_that_did_not_run_fails_every_adapter():
    served = fake_served(["one"])
    served["cudagraph"] = {"error": "vLLM (cudagraph) exited 1: boom"}
    result = usermodel.judge(served, ["one"], fake_controls(["one"]), merged(served, ["one"]))
    assert result.adapters[0].verdict == "FAILED" and result.verdict == "FAILED"
    assert "cudagraph: vLLM ran" in words(result.adapters[0].why)


# ----- the PEFT reference, and the choice between the two -----


def peft_served(served, base_off=0.02, lora_off=0.01, adapters=("one",)) -> dict:
    """What transformers + PEFT would answer: vLLM's base and LoRA, moved a little."""
    runs = {"base": copy.deepcopy(served["eager"]["runs"]["base"])}
    shift(runs["base"], base_off)
    for name in adapters:
        runs[f"lora:{name}"] = copy.deepcopy(served["eager"]["runs"][f"lora:{name}"])
        shift(runs[f"lora:{name}"], lora_off)
    return {"runs": runs, "device": "cpu", "seconds": 1.0, "peak_bytes": 1}


@pytest.fixture
def fake_peftref(monkeypatch, tmp_path):
    """patchkit.verify.peftref as its interface reads: job() gives a serving.Job whose
    runner (``python -m RUNNER JOB OUT``) writes OUT; here a child module that copies a
    prepared result, and the job's arguments recorded."""
    calls = []
    module = types.ModuleType("patchkit.verify.peftref")
    source = tmp_path / "peft-result.json"
    runner = tmp_path / "runners" / "fake_peft_runner.py"
    runner.parent.mkdir()
    runner.write_text(f"import shutil, sys\nshutil.copy({str(source)!r}, sys.argv[2])\n")
    monkeypatch.setenv("PYTHONPATH", f"{runner.parent}:{os.environ.get('PYTHONPATH', '')}")

    def job(model_dir, adapters, prompts, name="peft-reference"):
        calls.append((model_dir, dict(adapters), list(prompts), name))
        return serving.Job(name, str(model_dir), "peft", prompts, [], runner="fake_peft_runner")

    module.job = job
    monkeypatch.setitem(sys.modules, "patchkit.verify.peftref", module)
    # `from patchkit.verify import peftref` reads the package's attribute first
    monkeypatch.setattr(patchkit.verify, "peftref", module, raising=False)
    return types.SimpleNamespace(calls=calls, result=source)


@pytest.fixture
def user(tmp_path):
    from tests.checkpoint_helpers import HEAD_DIM, HEADS, VL, H, base_tensors, lin, write_checkpoint

    model = write_checkpoint(tmp_path / "model", base_tensors())
    factors = {f"{VL}layers.1.self_attn.q_proj": lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)}
    return {"model": model, "one": write_adapter(tmp_path / "one", factors)}


def serve_fake(monkeypatch, served):
    def serve_all(jobs, work, timeout, at_once, ready=None):
        when_ready(jobs, ready)
        return served

    monkeypatch.setattr(serving, "serve_all", serve_all)


def run(user, tmp_path, reference):
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0, reference)
    work = tmp_path / "work"
    return usermodel.run_model(user["model"], setup, work, None, (1 << 40, 1 << 40), print)


def test_reference_peft_judges_against_transformers_with_vllms_own_error_as_floor(
    user, tmp_path, monkeypatch, fake_peftref
):
    served = fake_served(["one"])
    for name in ("merged-one", "rounding-one"):
        del served[name]
    serve_fake(monkeypatch, served)
    fake_peftref.result.write_text(json.dumps(peft_served(served, base_off=0.04)))
    result = run(user, tmp_path, "peft")
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("PASSED", "peft"), words(verdict.why)
    assert words(verdict.reference_why) == "--reference peft"
    [(model, adapters, prompts, _)] = fake_peftref.calls
    assert (model, list(adapters), prompts) == (user["model"], ["one"], ["p600", "p3000"])
    row = {c.name: c for c in result.checks}["eager: one 600 tokens vs peft"]
    # LoRA 0.01 from PEFT's LoRA, in units of |vLLM base - PEFT base| 0.04
    assert row.ok and "0.25x vLLM's own base error 0.0400 (<= 1.8x" in row.detail
    assert not [c for c in result.checks if c.name.startswith("reference one")]


def spiked(group: dict, by: float, spike: float) -> None:
    """Move every prompt log-probability by ``by`` and the 10th of each prompt by
    ``spike``: one token a near-tied routing choice flipped."""
    shift(group, by)
    for one in group.values():
        one["prompt_logprobs"][10] += spike - by


def wide_moe_peft(served: dict, lora_spike: float) -> dict:
    """A transformers + PEFT answer as the H200's 35B-A3B-wide cut gave it: vLLM base
    0.30 mean and 2.9 max from float32 base, LoRA 0.35 mean from PEFT's LoRA with one
    token ``lora_spike`` away."""
    result = peft_served(served)
    spiked(result["runs"]["base"], 0.30, 2.9)
    runs = result["runs"]["lora:one"]
    for prompt, one in runs.items():  # start from vLLM's own LoRA answer again
        one["prompt_logprobs"] = list(
            served["eager"]["runs"]["lora:one"][prompt]["prompt_logprobs"]
        )
    spiked(runs, 0.35, lora_spike)
    return result


@pytest.mark.parametrize(
    "spike, verdict",
    [(2.6, "PASSED"), (4.0, "PASSED"), (4.5, "INCONCLUSIVE"), (8.0, "INCONCLUSIVE")],
)
def test_against_peft_the_max_bound_is_the_engines_own_worst_token_not_the_merged_ceiling(
    user, tmp_path, monkeypatch, fake_peftref, spike, verdict
):
    """Against float32 the floor is vLLM's own error: a LoRA token within 1.5x the
    engine's own worst token (2.9 -> 4.35) passes where the merged reference's 2-nat
    ceiling left the healthy wide MoE undecided; beyond it, or beyond 6 nats, it does
    not pass (undecided: a 0.30 mean floor is too coarse to call vLLM wrong)."""
    served = fake_served(["one"], effect=3.0)  # its half-strength control 1.5 away
    for name in ("merged-one", "rounding-one"):
        del served[name]
    serve_fake(monkeypatch, served)
    fake_peftref.result.write_text(json.dumps(wide_moe_peft(served, spike)))
    [result] = run(user, tmp_path, "peft").adapters
    assert result.verdict == verdict, words(result.why)
    assert all(c.rejected for c in result.controls)


def test_the_peft_reference_fails_a_lora_path_far_from_it(
    user, tmp_path, monkeypatch, fake_peftref
):
    served = fake_served(["one"])
    serve_fake(monkeypatch, served)
    fake_peftref.result.write_text(json.dumps(peft_served(served, lora_off=0.2)))
    [verdict] = run(user, tmp_path, "peft").adapters
    assert verdict.verdict == "FAILED" and "vs peft" in words(verdict.why)


def test_without_reference_a_coarse_merged_reference_hands_over_to_peft(
    user, tmp_path, monkeypatch, fake_peftref
):
    served = fake_served(["one"])
    shift(served["rounding-one"]["runs"]["merged"], 0.3)  # the merge's roundings 0.3 apart
    serve_fake(monkeypatch, served)
    fake_peftref.result.write_text(json.dumps(peft_served(served)))
    result = run(user, tmp_path, None)
    [verdict] = result.adapters
    assert (verdict.verdict, verdict.reference) == ("PASSED", "peft"), words(verdict.why)
    assert words(verdict.reference_why).startswith("the merged reference could not decide (")
    assert "the PEFT reference decides" in words(verdict.reference_why)
    assert len(fake_peftref.calls) == 1


def test_without_reference_a_precise_merged_reference_judges_alone(
    user, tmp_path, monkeypatch, fake_peftref
):
    serve_fake(monkeypatch, fake_served(["one"]))
    [verdict] = run(user, tmp_path, None).adapters
    assert (verdict.verdict, verdict.reference) == ("PASSED", "merged")
    assert words(verdict.reference_why).startswith("its own bf16 rounding is small (mean 0.0040")
    assert fake_peftref.calls == []


def test_a_peft_reference_that_did_not_run_leaves_the_merged_verdict_and_says_why(
    user, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "patchkit.verify.peftref", None)  # cannot be imported
    monkeypatch.delattr(patchkit.verify, "peftref", raising=False)
    served = fake_served(["one"])
    shift(served["rounding-one"]["runs"]["merged"], 0.3)
    serve_fake(monkeypatch, served)
    [verdict] = run(user, tmp_path, None).adapters
    assert (verdict.verdict, verdict.reference) == ("INCONCLUSIVE", "merged")
    assert "; it did not run, the PEFT reference: patchkit.verify.peftref cannot be imported" in (
        words(verdict.reference_why)
    )


# ----- the controls' files -----

PEFT_SAVED = torch.load(DATA / "peft-0.21.2-moe-one-parameter.pt", weights_only=True)
ATTENTION = "base_model.model.model.language_model.layers.0.self_attn.q_proj"


def saved_adapter(path: Path, kind: str, attention: bool = True) -> Path:
    """PEFT 0.21.2's own expert factors (``down``, ``gate_up``: one parameter; ``both``:
    the base_layer layout), with a q_proj factor beside them unless ``attention`` is off."""
    tensors = {k: v.to(torch.bfloat16) for k, v in PEFT_SAVED[kind]["tensors"].items()}
    if attention:
        tensors[f"{ATTENTION}.lora_A.weight"] = torch.ones(2, 12, dtype=torch.bfloat16)
        tensors[f"{ATTENTION}.lora_B.weight"] = torch.full((12, 2), 0.375, dtype=torch.bfloat16)
    return write_adapter(path, {}, _extra=tensors, **PEFT_SAVED[kind]["config"])


@pytest.mark.parametrize("kind", ["down", "gate_up", "both"])
def test_controls_of_peft_saved_expert_adapters(tmp_path, kind):
    adapter = saved_adapter(tmp_path / "a", kind)
    keys = list(PEFT_SAVED[kind]["tensors"])
    assert all(adaptercontrols.is_expert_key(k) for k in keys), keys
    if kind == "both":
        assert any(".mlp.experts.base_layer.lora_A" in k for k in keys)
    controls = adaptercontrols.build("a", adapter, tmp_path / "work")
    assert [(c.kind, c.what) for c in controls] == [
        (HALF, "50 % strength"), (NO_EXPERTS, "experts ignored"), (IGNORED, "adapter ignored")
    ]  # fmt: skip
    half, no_experts, ignored = controls
    original = st_read(adapter / "adapter_model.safetensors")
    halved = st_read(half.path / "adapter_model.safetensors")
    assert halved.keys() == original.keys()
    for key, value in original.items():
        factor = 0.5 if ".lora_B." in key else 1.0
        assert halved[key].dtype == value.dtype and torch.equal(halved[key], value * factor), key
    assert (half.path / "adapter_config.json").read_bytes() == (
        adapter / "adapter_config.json"
    ).read_bytes()
    dropped = st_read(no_experts.path / "adapter_model.safetensors")
    assert sorted(dropped) == [f"{ATTENTION}.lora_A.weight", f"{ATTENTION}.lora_B.weight"]
    config = json.loads((no_experts.path / "adapter_config.json").read_text())
    assert config["target_parameters"] is None
    assert ignored.path is None and ignored.label == "base"
    assert half.name == "a+half" and half.label == "control:a+half"


def test_an_adapter_of_experts_only_has_its_experts_ignored_control_on_base(tmp_path):
    adapter = saved_adapter(tmp_path / "a", "both", attention=False)
    controls = adaptercontrols.build("a", adapter, tmp_path / "work")
    assert [(c.kind, c.path is None) for c in controls] == [
        (HALF, False), (NO_EXPERTS, True), (IGNORED, True)
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["control-a+half"]


def test_controls_of_a_per_expert_adapter_keep_the_shared_expert(tmp_path):
    layer = "base_model.model.model.layers.0.mlp"
    factors = {
        f"model.layers.0.mlp.experts.{e}.{proj}": (torch.ones(2, 8), torch.ones(8, 2))
        for e in (0, 1)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    factors["model.layers.0.mlp.shared_expert.gate_proj"] = (torch.ones(2, 8), torch.ones(8, 2))
    adapter = write_adapter(tmp_path / "a", factors)
    half, no_experts, _ = adaptercontrols.build("a", adapter, tmp_path / "work")
    kept = st_read(no_experts.path / "adapter_model.safetensors")
    assert sorted(kept) == [
        f"{layer}.shared_expert.gate_proj.lora_A.weight",
        f"{layer}.shared_expert.gate_proj.lora_B.weight",
    ]
    assert torch.equal(
        st_read(half.path / "adapter_model.safetensors")[
            f"{layer}.experts.1.down_proj.lora_B.weight"
        ],
        torch.full((8, 2), 0.5, dtype=torch.bfloat16),
    )


def test_a_dense_adapter_has_no_experts_control():
    assert not adaptercontrols.is_expert_key(
        "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    )
    assert not adaptercontrols.is_expert_key(
        "base_model.model.model.layers.0.mlp.shared_expert.up_proj.lora_B.weight"
    )
    assert adaptercontrols.is_expert_key("model.layers.3.mlp.experts.lora_B.weight")


def test_the_controls_are_served_in_the_lora_engines(user, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    controls = {"one": adaptercontrols.build("one", user["one"], work)}
    setup = {"prompts": {"p600": [1] * 600}, "tensor_parallel_size": 1, "max_model_len": 616,
             "seed": 1, "gpu_memory_utilization": 0.1, "kv_cache_bytes": 1 << 30}  # fmt: skip
    jobs = engines.jobs(user["model"], {"one": user["one"]}, {}, setup, controls=controls)
    assert [j.name for j in jobs] == ["eager", "cudagraph", "nolora-eager", "nolora-cudagraph"]
    assert jobs[0].loras == {"one": str(user["one"]), "one+half": str(work / "control-one+half")}
    assert ("control:one+half", "p600", "one+half") in jobs[0].requests


# ----- --workdir and --keep: one rule -----


@pytest.mark.parametrize("option", ["--workdir", "--keep"])
def test_workdir_and_keep_are_each_new_or_empty(tmp_path, option):
    def asked(path):
        args = (str(path), None) if option == "--workdir" else (None, str(path))
        return verify_request(True, None, (), 1, None, args[0], None, args[1])

    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    assert asked(tmp_path / "new") and not (tmp_path / "new").exists()  # created when run
    assert asked(tmp_path / "empty")
    with pytest.raises(UsageProblem, match=rf"^{option} {tmp_path / 'full'}: not empty"):
        asked(tmp_path / "full")
    with pytest.raises(UsageProblem, match=rf"^{option} {tmp_path / 'file'}: not a directory"):
        asked(tmp_path / "file")


def test_a_new_workdir_is_created_and_removed_after_the_run(user, tmp_path, monkeypatch):
    seen = []

    def serve_all(jobs, work, timeout, at_once, ready=None):
        when_ready(jobs, ready)
        seen.append(work.parent.is_dir())
        return fake_served(["one"])

    monkeypatch.setattr(serving, "serve_all", serve_all)
    result = run(user, tmp_path, "merged")
    assert seen == [True] and result.adapters[0].verdict == "PASSED"
    assert not (tmp_path / "work").exists()


def test_request_rows_of_the_helpers_are_what_serving_collects():
    assert set(request([1.0])) == {"prompt_logprobs", "tokens", "token_logprobs"}


def test_a_link_planted_under_keep_after_its_check_is_refused_not_written_through(
    user, tmp_path, monkeypatch
):
    """--keep K was empty when verify started; minutes later (the GPU checks, --e2e)
    K/model is a link to another directory: verify refuses before its first write
    instead of writing served.json, the references and the controls there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "served.json").write_text("the victim's\n")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "model").symlink_to(victim)
    serve_fake(monkeypatch, fake_served(["one"]))
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0, "merged")
    with pytest.raises(PatchkitError, match="a link or not a directory by the time"):
        usermodel.run_model(user["model"], setup, None, keep / "model", (1 << 40,) * 2, print)
    assert sorted(os.listdir(victim)) == ["served.json"]
    assert (victim / "served.json").read_text() == "the victim's\n"


def test_a_keep_the_user_gives_as_a_link_is_followed_once_at_the_start(user, tmp_path, monkeypatch):
    """--keep scratch, where scratch is the user's link to an empty directory on another
    disk: taken as the real path when verify starts, written there; only a link put in
    place afterwards is refused (the test above)."""
    real = tmp_path / "big-disk" / "verify-run"
    real.mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(real)
    request = verify_request(False, None, (), 1, None, None, None, str(tmp_path / "scratch"))
    assert request.keep == real
    serve_fake(monkeypatch, fake_served(["one"]))
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0, "merged")
    usermodel.run_model(user["model"], setup, None, request.keep, (1 << 40,) * 2, print)
    assert (real / "served.json").is_file()


def test_a_run_removes_only_its_own_files_from_a_workdir_it_created(user, tmp_path, monkeypatch):
    """What another run (or the user) puts in --workdir meanwhile stays: verify removes
    its own directory in it, and --workdir itself only when that leaves it empty."""
    workdir = tmp_path / "shared-workdir"

    def serve_all(jobs, work, timeout, at_once, ready=None):
        when_ready(jobs, ready)
        (workdir / "other-run").mkdir()
        (workdir / "other-run" / "results.json").write_text("not verify's\n")
        return fake_served(["one"])

    monkeypatch.setattr(serving, "serve_all", serve_all)
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0, "merged")
    usermodel.run_model(user["model"], setup, workdir, None, (1 << 40,) * 2, print)
    assert os.listdir(workdir) == ["other-run"]
    assert (workdir / "other-run" / "results.json").read_text() == "not verify's\n"


def test_the_report_keeps_a_long_check_name_apart_from_its_result():
    """The base-rows row is 66 characters: it ran into its result ("...without LoRAok")."""
    from patchkit.cli.commands.verify import check_table
    from patchkit.verify.checks import Check

    name = "cudagraph: base requests of the LoRA engine equal an engine without LoRA"
    head, row = check_table("model check", [Check(name, True, "bit-identical: True")])
    assert row.split()[-3:] == ["ok", "bit-identical:", "True"]
    assert head.index("result") == row.index("ok") > len(name)
