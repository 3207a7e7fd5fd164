"""`patchkit verify`: its refusal without a GPU, and the judging logic it applies.

The judging code (kernelcheck._judge, e2e.compare) runs here on the CPU with
crafted numbers, so each failure it must catch is shown to be caught. The
real run needs a CUDA GPU and vLLM; its output on the test H200 is in
docs/evidence.md.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from patchkit.verify import e2e, kernelcheck
from tests.conftest import run_cli, run_subprocess
from tests.helpers import failing

torch = pytest.importorskip("torch", reason="verify's checks need torch (the test extra)")
has_gpu_and_vllm = torch.cuda.is_available() and __import__("importlib").util.find_spec("vllm")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_verify_says_so_in_one_line_and_exits_1():
    result = run_subprocess("verify")
    assert result.returncode == 1
    # torch itself may warn on import (e.g. without numpy); ours is one line, last.
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "patchkit: error: verify needs an NVIDIA GPU and none is visible to torch "
        "(torch.cuda.is_available() is False); run it on the GPU server"
    )
    as_json = run_cli("verify", "--json")
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["ok"] is False


@pytest.mark.gpu
@pytest.mark.skipif(
    not has_gpu_and_vllm, reason="needs a CUDA GPU and vLLM: run `patchkit verify` on a GPU host"
)
def test_verify_kernel_checks_pass_on_this_gpu():
    result = run_subprocess("verify", "--json")
    assert result.returncode == 0, result.stdout[-2000:]


# ----- kernelcheck._judge: rows with and without LoRA -----


def judged_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, rank, width = 12, 16, 4, 8
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    a = [torch.randn(2, 1, rank, hidden, generator=gen).bfloat16() / 4]
    b = [torch.randn(2, 1, width, rank, generator=gen).bfloat16() / 2]
    y = torch.randn(tokens, width, generator=gen).bfloat16()
    slots = torch.tensor([-1, 0, 1, 0, -1, 1, 1, 0, -1, 0, 1, 0])
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].double() @ a[0][slot, 0].double().T) @ b[0][slot, 0].double().T
    return out.bfloat16(), y, x, a, b, (width,), slots


def test_judge_passes_a_correct_result():
    result = kernelcheck._judge("case", *judged_case())
    assert result.ok and result.nonfinite == 0 and result.rel_error < kernelcheck.BF16_REL_TOL


def test_judge_fails_a_changed_row_without_lora_even_by_one_bit():
    out, y, *rest = judged_case()
    out[0] = y[0]
    out[0, 3] = torch.nextafter(y[0, 3].float(), torch.tensor(math.inf)).bfloat16()
    if torch.equal(out[0], y[0]):  # the bf16 rounding kept it: flip the sign instead
        out[0, 3] = -y[0, 3]
    result = kernelcheck._judge("case", out, y, *rest)
    assert not result.ok and "CHANGED" in result.detail


def test_judge_fails_nan_and_wrong_values():
    out, *rest = judged_case()
    nan = out.clone()
    nan[1, 0] = float("nan")
    assert not kernelcheck._judge("case", nan, *rest).ok
    wrong = out.clone()
    wrong[2] *= 1.5
    result = kernelcheck._judge("case", wrong, *rest)
    assert not result.ok and result.rel_error > kernelcheck.BF16_REL_TOL


# ----- kernelcheck.judge_route: the torch path's own routes' cases -----


def gemv_judged_case(add_inputs=True, seed=1):
    """A correct GEMV-route result on 8 slots: rows without LoRA, good adapters, the
    bad slot's rows NaN, the empty slot's rows y (adding) or 0 (writing)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, rank, widths = 16, 4, (8, 4)
    bad, empty = kernelcheck.GEMV_BAD_SLOT, kernelcheck.GEMV_EMPTY_SLOT
    x = torch.randn(6, hidden, generator=gen).bfloat16()
    a = [torch.randn(8, 1, rank, hidden, generator=gen).bfloat16() / 4 for _ in widths]
    b = [torch.randn(8, 1, w, rank, generator=gen).bfloat16() / 2 for w in widths]
    for t in (*a, *b):
        t[empty].zero_()
    y = torch.randn(6, sum(widths), generator=gen).bfloat16()
    slots = torch.tensor([bad, 0, -1, empty, 1, bad])
    out = y.double().clone() if add_inputs else torch.zeros(6, sum(widths), dtype=torch.float64)
    out[slots < 0] = y[slots < 0].double()
    offset = 0
    for a_s, b_s, w in zip(a, b, widths, strict=True):
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                shrunk = x[t].double() @ a_s[slot, 0].double().T
                out[t, offset : offset + w] += shrunk @ b_s[slot, 0].double().T
        offset += w
    out[slots == bad] = float("nan")
    return out.bfloat16(), y, x, a, b, widths, slots, add_inputs


def test_judge_route_passes_a_correct_result_adding_and_writing():
    for add_inputs in (True, False):
        result = kernelcheck.judge_route("case", *gemv_judged_case(add_inputs), [True])
        assert result.ok, result.detail
        assert "GEMV route taken" in result.detail and "2 rows of the bad adapter NaN" in (
            result.detail
        )


def test_judge_route_fails_when_the_route_did_not_run():
    """The GEMM route gives the same numbers: only what gemv_linear returned tells."""
    for taken in ([], [False], [True, True]):
        result = kernelcheck.judge_route("case", *gemv_judged_case(), taken)
        assert not result.ok and "NOT taken" in result.detail


def test_judge_route_names_the_route_it_judges():
    """Another route's cases are judged as the GEMV route's, under their own name."""
    result = kernelcheck.judge_route("case", *gemv_judged_case(), [True], route="other route")
    assert result.ok and "other route taken" in result.detail
    result = kernelcheck.judge_route("case", *gemv_judged_case(), [False], route="other route")
    assert not result.ok and "other route NOT taken ([False])" in result.detail


def test_judge_route_fails_a_bad_adapter_that_reaches_other_rows_or_not_its_own():
    out, *rest = gemv_judged_case()
    leaked = out.clone()
    leaked[1, 0] = float("nan")  # a good adapter's row
    assert not kernelcheck.judge_route("case", leaked, *rest, [True]).ok
    plain = out.clone()
    plain[2, 1] = float("nan")  # a row without LoRA
    result = kernelcheck.judge_route("case", plain, *rest, [True])
    assert not result.ok and "CHANGED" in result.detail
    finite = out.clone()
    finite[0, 3] = 0.0  # the bad adapter's row not NaN everywhere
    result = kernelcheck.judge_route("case", finite, *rest, [True])
    assert not result.ok and "NOT all NaN" in result.detail
    wrong = out.clone()
    wrong[4] *= 1.5
    result = kernelcheck.judge_route("case", wrong, *rest, [True])
    assert not result.ok and result.rel_error > kernelcheck.BF16_REL_TOL


def test_the_gemv_cases_cover_every_kind_of_row_at_each_token_count():
    """1, 2, 4 and 8 tokens per slice count: each call has a LoRA row (else vLLM skips
    the ops), and the one-token calls are a bad, a good and an empty slot's row."""
    rows, widths = kernelcheck.GEMV_ROWS, kernelcheck.GEMV_WIDTHS
    assert kernelcheck.GEMV_TOKENS == (1, 2, 4, 8) and {len(w) for w in widths} == {1, 2, 3, 4}
    for n in range(len(widths)):
        for tokens in kernelcheck.GEMV_TOKENS:
            assert any(rows[(n + i) % len(rows)] for i in range(tokens))
    first = {rows[n % len(rows)] - 1 for n in range(len(widths))}
    assert {kernelcheck.GEMV_BAD_SLOT, kernelcheck.GEMV_EMPTY_SLOT} < first
    assert first - {kernelcheck.GEMV_BAD_SLOT, kernelcheck.GEMV_EMPTY_SLOT} <= set(
        kernelcheck.GEMV_RANKS
    )
    assert set(rows) - {0} <= set(range(1, 9)) and 0 in rows


def test_the_active_slot_cases_are_batches_the_path_narrows():
    """1,024 and 4,096 tokens (at least ACTIVE_MIN_TOKENS) on at most half of the 8
    slots, so the path takes its narrowed GEMMs: the bad adapter's, the empty slot's,
    a good adapter's, and rows without LoRA, whichever slice count starts the cycle."""
    module = kernelcheck.ACTIVE
    rows = module.rows
    assert min(module.tokens) >= 512 and module.add_inputs == (True, False)
    assert module.settings == (("ACTIVE_MIN_WORK", 0),)  # its shapes skip less than the rule
    slots = {r - 1 for r in rows if r}
    assert 0 in rows and 2 * len(slots) <= 8
    assert {kernelcheck.GEMV_BAD_SLOT, kernelcheck.GEMV_EMPTY_SLOT} < slots
    assert slots - {kernelcheck.GEMV_BAD_SLOT, kernelcheck.GEMV_EMPTY_SLOT} <= set(
        kernelcheck.GEMV_RANKS
    )


# ----- e2e.compare: every end-to-end failure it must catch -----


def served(mode_noise=0.0):
    """A served result that matches a reference exactly, and that reference."""
    reference = {"base": {}, "lora": {}}
    runs = {k: {} for k in ("base", "lora", "lora_after_long", "base_after_lora")}
    for n in e2e.PROMPT_LENGTHS:
        name = f"p{n}"
        base = [-8.3 + 0.01 * (i % 7) for i in range(n - 1)]
        lora = [v - 0.3 for v in base]
        reference["base"][name], reference["lora"][name] = base, lora
        for label, values in (("base", base), ("lora", lora), ("base_after_lora", base)):
            runs[label][name] = {"prompt_logprobs": list(values), "tokens": [5, 6, 7],
                                 "token_logprobs": [-1.0, -1.0, -1.0]}  # fmt: skip
    runs["lora_after_long"]["p50"] = copy.deepcopy(runs["lora"]["p50"])
    for kind in e2e.PARTIAL_ADAPTERS:
        partial = [v - 0.05 for v in reference["base"][e2e.PARTIAL_PROMPT]]
        reference[kind] = {e2e.PARTIAL_PROMPT: partial}
        runs[kind] = {e2e.PARTIAL_PROMPT: {"prompt_logprobs": list(partial), "tokens": [5],
                                           "token_logprobs": [-1.0]}}  # fmt: skip
    return {"mode": "eager", "corrupted_requests": 0, "runs": runs}, reference


def test_compare_passes_a_clean_run():
    result, reference = served()
    assert failing(e2e.compare("eager", result, reference)) == []


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda r: r["runs"]["lora"]["p600"]["prompt_logprobs"].__setitem__(3, math.nan),
         "eager: no NaN log-probabilities"),
        (lambda r: r["runs"]["lora"]["p3000"].__setitem__("tokens", [0, 0, 0, 0]),
         "eager: no run of token id 0"),
        (lambda r: r.__setitem__("corrupted_requests", 2), "eager: vllm:corrupted_requests"),
        (lambda r: r["runs"]["lora"].update(copy.deepcopy(r["runs"]["base"])),
         "eager: LoRA output differs from base"),
        (lambda r: r["runs"]["base_after_lora"].update(copy.deepcopy(r["runs"]["lora"])),
         "eager: base after LoRA equals base before"),
        (lambda r: r["runs"]["lora_after_long"]["p50"].__setitem__("tokens", [9, 9, 9]),
         "eager: short prompt after a long one unaffected"),
        (lambda r: r["runs"]["base"]["p600"]["prompt_logprobs"].__setitem__(0, -9.0),
         "eager: base 600 tokens vs transformers"),
        (lambda r: r["runs"].__setitem__("lora_z", {"error": "ValueError: Cannot determine"}),
         "eager: lora_z adapter served"),
        (lambda r: r["runs"]["lora_qkv"]["p600"]["prompt_logprobs"].__setitem__(2, -9.0),
         "eager: lora_qkv adapter vs transformers"),
        (lambda r: r["runs"]["lora_z"].update(copy.deepcopy(r["runs"]["base"])),
         "eager: lora_z adapter differs from base"),
    ],
)  # fmt: skip
def test_compare_catches(damage, expected):
    result, reference = served()
    damage(result)
    assert expected in failing(e2e.compare("eager", result, reference))


def test_compare_reports_an_engine_that_did_not_run():
    checks = e2e.compare("cudagraph", {"error": "vLLM (cudagraph) exited 1: boom"}, {})
    assert [(c.name, c.ok) for c in checks] == [("cudagraph: vLLM ran", False)]
