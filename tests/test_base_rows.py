"""Base rows stay base: the LoRA engine's base requests against an engine without LoRA.

Judged on crafted served results (the form patchkit.verify.serving writes) and
on the MoE engines really served on the H200 (tests/data, the `moe-` entries
of served.json, recorded before the engines without LoRA existed: their base
answers stand in for them). Bit-identical is required where the LoRA path adds
exact zeros for base rows (patchkit's torch path, eager, no routed experts);
elsewhere the bound is measured in the run, eager vs CUDA graphs without LoRA.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

import pytest

from patchkit.verify import baserows, e2e, engines, modelchecks, rule, serving

DATA = Path(__file__).parent / "data"
TITLE = "base requests of the LoRA engine equal an engine without LoRA"


def request(values, tokens=(5, 6, 7)):
    return {"prompt_logprobs": list(values), "tokens": list(tokens), "token_logprobs": [-1.0] * 3}


BASE = {"p600": [-8.0 + 0.01 * (i % 7) for i in range(599)], "p50": [-7.5] * 49}


def served(backend="torch", experts=0, graph_noise=0.002, prefix="") -> dict:
    """LoRA engines whose base rows equal the engines without LoRA of their mode; the
    CUDA-graph engines differ from the eager ones by ``graph_noise`` per token."""
    out = {}
    for mode, shift in (("eager", 0.0), ("cudagraph", graph_noise)):
        base = {p: request([v + shift for v in values]) for p, values in BASE.items()}
        out[f"{prefix}{mode}"] = {
            "corrupted_requests": 0,
            "lora_backend": backend,
            "routed_experts": experts,
            "runs": {"base": copy.deepcopy(base), "lora:a": {}},
        }
        out[f"{prefix}nolora-{mode}"] = {"corrupted_requests": 0, "runs": {"base": base}}
    return out


def judged(result: dict, prefix: str = "") -> dict[str, baserows.Check]:
    names = {mode: f"{prefix}{mode}" for mode in serving.MODES}
    return {c.name: c for c in baserows.base_rows_checks(result, names, prefix)}


def row(result: dict, mode: str, prefix: str = "") -> baserows.Check:
    return judged(result, prefix)[f"{prefix}{mode}: {TITLE}"]


def test_a_healthy_run_passes_every_row_and_names_the_check():
    rows = judged(served())
    assert [name for name, c in rows.items() if not c.ok] == []
    assert set(rows) >= {f"eager: {TITLE}", f"cudagraph: {TITLE}"}
    assert "bit-identical: True (required" in rows[f"eager: {TITLE}"].detail


def test_on_the_torch_path_eager_base_rows_one_bit_off_fail():
    result = served()
    value = result["eager"]["runs"]["base"]["p600"]["prompt_logprobs"][100]
    result["eager"]["runs"]["base"]["p600"]["prompt_logprobs"][100] = math.nextafter(value, 0)
    check = row(result, "eager")
    assert not check.ok and "bit-identical: False (required" in check.detail
    assert row(result, "cudagraph").ok  # the other mode is its own row


def test_on_the_torch_path_a_different_greedy_token_fails_eager():
    result = served()
    result["eager"]["runs"]["base"]["p50"]["tokens"][2] = 8
    assert not row(result, "eager").ok


@pytest.mark.parametrize(
    "backend, experts, mode",
    [("torch", 0, "cudagraph"), ("torch", 8, "eager"), ("triton", 0, "eager"), (None, 0, "eager")],
)
def test_where_no_exact_zeros_are_promised_equality_is_not_required(backend, experts, mode):
    result = served(backend=backend, experts=experts)
    lora = result[mode]["runs"]["base"]["p600"]
    lora["prompt_logprobs"] = [v + 0.001 for v in lora["prompt_logprobs"]]  # kernel noise
    check = row(result, mode)
    assert check.ok and "bit-identical: False (not required" in check.detail
    assert baserows.exact_expected(result[mode], mode) is False


def test_base_rows_that_take_an_adapters_delta_fail_in_every_mode():
    for experts in (0, 8):
        result = served(backend="triton", experts=experts)
        for mode in serving.MODES:
            lora = result[mode]["runs"]["base"]["p600"]
            lora["prompt_logprobs"] = [v - 0.3 for v in lora["prompt_logprobs"]]
            assert not row(result, mode).ok


def test_the_bound_is_the_distance_between_the_engines_without_lora_times_the_factor():
    result = served(backend="triton", graph_noise=0.02)
    assert baserows.control(result) == pytest.approx((0.02, 0.02))
    assert baserows.bounds(baserows.control(result)) == (0.03, baserows.FLOOR[1])
    lora = result["eager"]["runs"]["base"]["p600"]
    lora["prompt_logprobs"] = [v + 0.025 for v in lora["prompt_logprobs"]]
    assert row(result, "eager").ok
    lora["prompt_logprobs"] = [v + 0.01 for v in lora["prompt_logprobs"]]  # 0.035 in all
    assert not row(result, "eager").ok
    assert baserows.bounds(None) == baserows.FLOOR
    assert baserows.bounds((1.0, 5.0)) == (1.5, rule.MAX_CEILING)


def test_an_engine_without_lora_that_did_not_run_fails_and_says_so():
    result = served()
    result["nolora-cudagraph"] = {"error": "vLLM (nolora-cudagraph) exited 1: OOM"}
    rows = judged(result)
    assert not rows["nolora-cudagraph: vLLM ran"].ok
    assert not rows[f"cudagraph: {TITLE}"].ok
    assert "not served" in rows[f"cudagraph: {TITLE}"].detail
    assert rows[f"eager: {TITLE}"].ok


def test_a_nan_in_the_engine_without_lora_fails_its_health_row():
    result = served()
    result["nolora-eager"]["runs"]["base"]["p50"]["prompt_logprobs"][0] = float("nan")
    assert not judged(result)["nolora-eager: no NaN log-probabilities"].ok


def test_a_run_recorded_before_these_engines_adds_no_row():
    result = served()
    for mode in serving.MODES:
        del result[f"nolora-{mode}"]
    assert baserows.base_rows_checks(result, {"eager": "eager"}) == []


# ----- where the engines come from: --model and --e2e, dense and MoE -----


COMMON = {"tensor_parallel_size": 1, "max_model_len": 4096, "seed": 3,
          "gpu_memory_utilization": 0.1, "kv_cache_bytes": 1 << 30}  # fmt: skip


@pytest.fixture
def no_rank_lookup(monkeypatch):
    monkeypatch.setattr(engines, "adapter_rank", lambda path: 16)


def test_verify_model_serves_the_base_prompts_without_lora_in_each_mode(no_rank_lookup):
    prompts = {"p600": [1] * 600, "p3000": [2] * 3000}
    setup = {"prompts": prompts, **COMMON}
    refs = {"one": {"merged": Path("/r/m"), "rounding": Path("/r/r")}}
    jobs = engines.jobs(Path("/m"), {"one": Path("/nowhere")}, refs, setup, prefix="moe-")
    plain = [j for j in jobs if j.name.startswith("moe-nolora-")]
    assert [(j.name, j.mode) for j in plain] == [
        ("moe-nolora-eager", "eager"),
        ("moe-nolora-cudagraph", "cudagraph"),
    ]
    for job in plain:
        assert job.loras == {} and job.model == "/m" and job.prompts == prompts
        assert job.requests == [("base", "p600", None), ("base", "p3000", None)]
        assert job.max_model_len == 4096 and job.kv_cache_bytes == 1 << 30


def test_verify_e2e_serves_the_dense_base_prompts_without_lora_in_each_mode():
    memory = {k: COMMON[k] for k in ("tensor_parallel_size", "gpu_memory_utilization",
                                     "kv_cache_bytes")}  # fmt: skip
    jobs = e2e.dense_jobs(Path("/m"), Path("/w/adapter"), 3, memory)
    plain = {j.name: j for j in jobs if not j.loras}
    assert list(plain) == ["nolora-eager", "nolora-cudagraph"]
    assert plain["nolora-eager"].prompts == e2e.prompts(3)
    assert [r[0] for r in plain["nolora-eager"].requests] == ["base"] * 3
    assert plain["nolora-eager"].max_model_len == 4096 and plain["nolora-eager"].seed == 3


# ----- on what the H200 served (the MoE case of --e2e, TP=1 and TP=2) -----


def recorded(tp: int) -> dict:
    """The recorded MoE run, with engines without LoRA that answer as the LoRA engine's
    base requests did (what a healthy LoRA path gives), and what the LoRA child records."""
    with gzip.open(DATA / f"h200-2026-11-30h-moe-tp{tp}-served.json.gz", "rt") as handle:
        result = json.load(handle)
    for mode in serving.MODES:
        lora = result[f"moe-{mode}"]
        lora |= {"lora_backend": "torch", "routed_experts": 8}
        result[f"moe-nolora-{mode}"] = {
            "corrupted_requests": 0,
            "runs": {"base": copy.deepcopy(lora["runs"]["base"])},
        }
    return result


@pytest.mark.parametrize("tp", [1, 2])
def test_the_recorded_moe_run_passes_and_its_kernel_noise_sets_the_bound(tp):
    result = recorded(tp)
    mean, worst = baserows.control(result, "moe-")
    assert 0.013 < mean < 0.023 and 0.4 < worst < 1.0  # eager vs CUDA graphs, real
    assert all(c.ok for c in judged(result, "moe-").values())
    # one mode's base rows against the other mode's engine: kernel noise, still passes
    result["moe-nolora-eager"], result["moe-nolora-cudagraph"] = (
        result["moe-nolora-cudagraph"],
        result["moe-nolora-eager"],
    )
    assert row(result, "eager", "moe-").ok and row(result, "cudagraph", "moe-").ok


@pytest.mark.parametrize("tp", [1, 2])
def test_recorded_base_rows_that_answer_as_the_adapter_fail(tp):
    result = recorded(tp)
    for mode in serving.MODES:
        runs = result[f"moe-{mode}"]["runs"]
        runs["base"] = copy.deepcopy(runs["lora:moe"])  # the adapter applied to base rows
        assert not row(result, mode, "moe-").ok


def test_verify_model_judges_base_rows_with_its_other_checks():
    result = recorded(1)
    assert [c.name for c in modelchecks.compare(result, ["moe"], prefix="moe-") if not c.ok] == []
    runs = result["moe-eager"]["runs"]
    runs["base"] = copy.deepcopy(runs["lora:moe"])
    failed = [c.name for c in modelchecks.compare(result, ["moe"], prefix="moe-") if not c.ok]
    assert f"moe-eager: {TITLE}" in failed and f"moe-cudagraph: {TITLE}" not in failed


# ----- what the LoRA engine's child records for the decision -----


@pytest.mark.parametrize(
    "config, experts",
    [
        ({"text_config": {"num_experts": 256, "num_experts_per_tok": 8}}, 256),
        ({"num_local_experts": 8}, 8),
        ({"text_config": {"hidden_size": 1024}}, 0),
        ({"num_experts": None}, 0),
    ],
)
def test_the_child_reads_the_routed_experts_from_config_json(tmp_path, config, experts):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert serving.routed_experts(str(tmp_path)) == experts


def test_without_patchkits_torch_path_the_backend_is_vllms_triton_kernels():
    # this machine has no vLLM tree on sys.path, so no patchkit_lora_matmul module
    assert serving.lora_backend() == "triton"
