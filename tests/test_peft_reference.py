"""The transformers + PEFT reference (patchkit.verify.peftref): what it answers, what it needs.

On a tiny random Qwen3.5-MoE on the CPU (the e2e MoE model's shape, shrunk:
8 routed experts top 2, a shared expert, 3 GDN + 1 attention layers) with
adapters PEFT itself saves, routed experts through ``target_parameters`` (both
parameters, ``down_proj`` alone, ``gate_up_proj`` alone) and attention/GDN
modules: its base is the model without any adapter, bit for bit; an adapter
moves the answer; the same adapter at half strength lands in between; the
unmerged float32 answer is the merged float32 one within float32 rounding;
the child writes what a served engine writes. The memory estimate and the
refusal need neither transformers nor peft. Tests that do skip, saying so,
where they are not installed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from patchkit.errors import PatchkitError
from patchkit.verify import checks, peftref, serving

torch = pytest.importorskip("torch", reason="the reference needs torch (the test extra)")

GIB = 1 << 30
# The e2e MoE model's layout at toy widths.
SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
ATTENTION_AND_GDN = r".*language_model.*\.(q_proj|v_proj|in_proj_qkv|out_proj)"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name: (target_modules, target_parameters)
ADAPTERS = {
    "full": (ATTENTION_AND_GDN, EXPERTS),
    "down": ([], ["mlp.experts.down_proj"]),
    "gate_up": ([], ["mlp.experts.gate_up_proj"]),
}
PROMPTS = {"p40": [(7 * i + 3) % 500 + 1 for i in range(40)], "p25": list(range(30, 55))}


def needs_peft():
    pytest.importorskip("transformers", reason="the reference needs transformers: pip "
                        "install -e '.[test]' (transformers 5.17, peft 0.21)")  # fmt: skip
    pytest.importorskip("peft", reason="the reference needs peft: pip install -e '.[test]'")


def scale_b(adapter_dir: Path, factor: float) -> None:
    """Multiply every lora_B in an adapter's file by ``factor`` (as a user's weaker adapter)."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = {
        k: (v.float() * factor).to(v.dtype) if "lora_B" in k else v
        for k, v in load_file(path).items()
    }
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3.5-MoE (bf16) and PEFT 0.21 adapters on it, as PEFT saves them."""
    needs_peft()
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5MoeForConditionalGeneration

    from patchkit.verify.e2e import qwen35_moe_config

    root = tmp_path_factory.mktemp("peftref")
    torch.manual_seed(3)
    model = Qwen3_5MoeForConditionalGeneration(qwen35_moe_config(**SMALL)).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    made = {"model": root / "model"}
    for name, (modules, parameters) in ADAPTERS.items():
        base = Qwen3_5MoeForConditionalGeneration.from_pretrained(
            root / "model", dtype=torch.bfloat16
        )
        config = LoraConfig(r=4, lora_alpha=4, target_modules=modules,
                            target_parameters=parameters, init_lora_weights=False,
                            exclude_modules=r".*visual.*")  # fmt: skip
        get_peft_model(base, config).save_pretrained(root / name)
        scale_b(root / name, 2.0)  # PEFT's random B is small: make the effect clear
        made[name] = root / name
    shutil.copytree(root / "full", root / "half")
    scale_b(root / "half", 0.5)
    made["half"] = root / "half"
    return made


@pytest.fixture(scope="module")
def answered(tiny) -> dict:
    """The reference's runs for base, the full adapter, its half, and the expert-only ones."""
    adapters = {n: tiny[n] for n in ("full", "half", "down", "gate_up")}
    plan = peftref.requests(adapters, PROMPTS)
    return peftref.reference_runs(
        lambda: peftref.load_base(tiny["model"], None), adapters, PROMPTS, plan
    )


def plain_logprobs(
    model_dir: Path, ids: list[int], adapter: Path | None = None, dense: bool = False
) -> list[float]:
    """transformers' own forward (full logits), float32, with ``adapter`` merged by PEFT."""
    import transformers

    name = "Qwen3_5ForConditionalGeneration" if dense else "Qwen3_5MoeForConditionalGeneration"
    model = getattr(transformers, name).from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        logits = model.eval()(input_ids=tokens).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, tokens[0, 1:, None]).squeeze(1).tolist()


def mean_diff(runs: dict, a: str, b: str, prompt: str = "p40") -> float:
    return checks.diff(checks.logprobs(runs, a, prompt), checks.logprobs(runs, b, prompt))[0]


# ----- what it answers -----


@pytest.mark.slow
def test_its_base_is_the_model_without_any_adapter_bit_for_bit(tiny, answered):
    for prompt, ids in PROMPTS.items():
        assert checks.logprobs(answered, "base", prompt) == plain_logprobs(tiny["model"], ids)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "down", "gate_up"])
def test_each_adapter_moves_the_answer(answered, adapter):
    assert len(checks.logprobs(answered, f"lora:{adapter}", "p40")) == len(PROMPTS["p40"]) - 1
    assert mean_diff(answered, f"lora:{adapter}", "base") > 0.02


@pytest.mark.slow
def test_the_adapter_at_half_strength_lands_in_between(answered):
    full = mean_diff(answered, "lora:full", "base")
    half = mean_diff(answered, "lora:half", "base")
    between = mean_diff(answered, "lora:full", "lora:half")
    # Not half the effect: near-tied routing choices make the answer non-linear in the
    # adapter (8 experts top 2, random weights), but nearer base than the full adapter is,
    # and nearer the full adapter than base is.
    assert 0.2 * full < half < full and 0.2 * full < between < full, (full, half, between)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "down", "gate_up"])
def test_unmerged_float32_is_the_merged_float32_forward(tiny, answered, adapter):
    merged = plain_logprobs(tiny["model"], PROMPTS["p40"], tiny[adapter])
    mean, worst = checks.diff(checks.logprobs(answered, f"lora:{adapter}", "p40"), merged)
    assert worst < 1e-3, (mean, worst)
    effect = mean_diff(answered, f"lora:{adapter}", "base")
    assert worst < effect / 20  # float32 rounding, far below what the adapter does


@pytest.mark.slow
def test_an_adapter_peft_refuses_is_marked_and_the_others_still_run(tiny, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny["down"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    adapters = {"broken": broken, "full": tiny["full"]}
    runs = peftref.reference_runs(
        lambda: peftref.load_base(tiny["model"], None),
        adapters,
        PROMPTS,
        peftref.requests(adapters, PROMPTS),
    )
    assert checks.served_error(runs, "lora:broken")
    assert mean_diff(runs, "lora:full", "base") > 0.02
    assert checks.logprobs(runs, "base", "p25") == plain_logprobs(tiny["model"], PROMPTS["p25"])


@pytest.mark.slow
def test_the_child_writes_what_a_served_engine_writes(tiny, tmp_path):
    adapters = {"full": tiny["full"]}
    job = peftref.job(tiny["model"], adapters, PROMPTS)
    result = serving.alone(job, tmp_path, timeout=300)
    assert "error" not in result, (tmp_path / f"vllm-{peftref.NAME}.log").read_text()[-2000:]
    assert result["device"] == "cpu" and result["seconds"] > 0 and result["peak_bytes"] > 0
    assert set(result["runs"]) == {"base", "lora:full"}
    assert set(result["runs"]["base"]) == set(PROMPTS)
    base = checks.logprobs(result["runs"], "base", "p40")
    assert base == plain_logprobs(tiny["model"], PROMPTS["p40"])
    assert mean_diff(result["runs"], "lora:full", "base") > 0.02


# ----- the job, the estimate and the refusal: no transformers needed -----


def test_the_job_is_a_serving_job_run_by_this_module_with_vllms_labels(tmp_path):
    adapters = {"a": tmp_path / "a", "b": tmp_path / "b"}
    job = peftref.job(tmp_path / "model", adapters, PROMPTS)
    assert job.runner == "patchkit.verify.peftref" and job.mode == peftref.MODE
    assert job.loras == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    assert job.requests == [
        ("base", "p40", None),
        ("base", "p25", None),
        ("lora:a", "p40", "a"),
        ("lora:a", "p25", "a"),
        ("lora:b", "p40", "b"),
        ("lora:b", "p25", "b"),
    ]
    # the child reads what serving.start writes
    again = serving.Job(**json.loads(json.dumps(asdict(job))))
    assert again.runner == job.runner and again.loras == job.loras


def test_vllm_jobs_still_run_the_serving_module():
    job = serving.Job(name="e", model="m", mode="eager", prompts={}, requests=[])
    assert job.runner == "patchkit.verify.serving"


def write_model(root: Path, tensors: dict, config: dict) -> Path:
    from patchkit.adapters.safetensorsfile import save_safetensors

    root.mkdir(parents=True, exist_ok=True)
    save_safetensors(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps(config))
    return root


def write_adapter(root: Path, tensors: dict, parameters: list[str]) -> Path:
    from patchkit.adapters.safetensorsfile import save_safetensors

    root.mkdir(parents=True, exist_ok=True)
    save_safetensors(root / "adapter_model.safetensors", tensors)
    config = {"r": 2, "lora_alpha": 2, "target_modules": [], "target_parameters": parameters}
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


def test_the_estimate_is_float32_weights_the_largest_adapter_group_and_working_memory(tmp_path):
    bf16 = torch.bfloat16
    model = write_model(
        tmp_path / "m",
        {
            "w": torch.zeros(10, 20, dtype=bf16),
            "experts": torch.zeros(4, 8, 16, dtype=bf16),
            "steps": torch.zeros(3, dtype=torch.int64),
        },  # fmt: skip
        {"text_config": {"vocab_size": 100, "hidden_size": 16}},
    )
    factors = {"base_model.model.x.lora_A.weight": torch.zeros(2, 16, dtype=bf16)}
    same = [write_adapter(tmp_path / n, factors, ["mlp.experts.down_proj"]) for n in ("a", "b")]
    other = write_adapter(tmp_path / "c", factors, ["mlp.experts.gate_up_proj"])
    adapters = {"a": same[0], "b": same[1], "c": other}
    need = peftref.estimate(model, adapters, {"p": [1] * 50, "q": [1] * 7})
    assert need.bf16 == (200 + 512) * 2 + 3 * 8
    assert need.weights == (200 + 512) * 4 + 3 * 8  # floats twice their bf16 bytes
    assert need.adapters == 2 * 32 * 4  # a and b load together; c alone, after them
    assert peftref.groups(adapters) == [["a", "b"], ["c"]]
    assert need.working == peftref.working_bytes(vocab=100, hidden=16, longest=50, largest=512)


def test_a_reference_the_visible_gpus_cannot_hold_is_refused_in_one_line():
    need = peftref.Estimate(weights=100 * GIB, adapters=GIB, working=10 * GIB, bf16=50 * GIB)
    with pytest.raises(PatchkitError) as refused:
        peftref.placement(need, [100 * GIB])
    line = str(refused.value)
    assert "\n" not in line and "1 visible GPU(s)" in line and "float32 is twice bf16" in line
    with pytest.raises(PatchkitError):
        peftref.placement(need, [])  # no GPU at all
    budgets = peftref.placement(need, [80 * GIB, 60 * GIB])
    assert budgets == {0: 70 * GIB, 1: 50 * GIB}  # each GPU keeps its working reserve


# Qwen3.5/3.6-35B-A3B, as the module's docstring counts it (transformers 5.17, meta device).
PARAMETERS_35B = 35_114_000_000
LARGEST_35B = 256 * 1024 * 2048  # one layer's experts' gate_up_proj
H200 = 140 * GIB


def test_a_full_35b_a3b_needs_two_h200s_not_one():
    need = peftref.Estimate(
        weights=PARAMETERS_35B * 4,
        adapters=0,
        working=peftref.working_bytes(
            vocab=248320, hidden=2048, longest=16384, largest=LARGEST_35B
        ),  # fmt: skip
        bf16=PARAMETERS_35B * 2,
    )
    assert 13 * GIB < need.working < 14 * GIB  # 14.9 GB
    with pytest.raises(PatchkitError):
        peftref.placement(need, [H200])
    assert sum(peftref.placement(need, [H200, H200]).values()) > need.spread


def test_the_child_writes_a_refusal_as_its_error_and_exits_0(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", {"w": torch.zeros(4, 4, dtype=torch.bfloat16)},
                        {"vocab_size": 8, "hidden_size": 4})  # fmt: skip
    job = peftref.job(model, {}, {"p": [1, 2, 3]})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peftref, "_gpus_free", lambda: [1024])
    monkeypatch.setattr(peftref, "_device", lambda: "1 x test")
    monkeypatch.setattr(peftref, "_peak_bytes", lambda: 0)
    out = tmp_path / "out.json"
    peftref.run(job, out)
    result = json.loads(out.read_text())
    assert result["error"].startswith("the float32 reference (transformers + PEFT) needs")
    assert "runs" not in result and result["device"] == "1 x test"


@pytest.mark.slow
def test_e2e_takes_its_dense_reference_from_here(tmp_path, monkeypatch):
    """--e2e's dense case: the full adapter and both partial GDN adapters (no
    target_parameters: one PEFT model holds them all), answered as e2e's checks read them."""
    needs_peft()
    from transformers import Qwen3_5ForConditionalGeneration

    from patchkit.verify import e2e

    small = {k: v for k, v in SMALL.items() if "expert" not in k} | {"intermediate_size": 64}
    e2e.save_random(Qwen3_5ForConditionalGeneration, e2e.qwen35_config(**small), 4,
                    tmp_path / "model", tmp_path / "adapter", e2e.TARGET_MODULES)  # fmt: skip
    for kind, target in e2e.PARTIAL_ADAPTERS.items():
        e2e.save_random(Qwen3_5ForConditionalGeneration, e2e.qwen35_config(**small), 4,
                        tmp_path / "unused", e2e.partial_dir(tmp_path / "adapter", kind),
                        target)  # fmt: skip
    asked = {"p50": PROMPTS["p40"], "p600": PROMPTS["p25"]}
    monkeypatch.setattr(e2e, "prompts", lambda seed: asked)
    monkeypatch.setattr(e2e, "PARTIAL_PROMPT", "p600")
    reference = e2e.reference_logprobs(tmp_path / "model", tmp_path / "adapter", 0)
    assert set(reference) == {"base", "lora", "lora_qkv", "lora_z"}
    assert set(reference["base"]) == set(reference["lora"]) == set(asked)
    assert set(reference["lora_qkv"]) == {"p600"}
    base = reference["base"]["p600"]
    assert base == plain_logprobs(tmp_path / "model", asked["p600"], dense=True)
    for kind in ("lora", "lora_qkv", "lora_z"):
        assert checks.diff(reference[kind]["p600"], base)[0] > 1e-3, kind
    assert reference["lora_qkv"]["p600"] != reference["lora_z"]["p600"]


def factor_shapes(adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    return {name: tuple(t.shape) for name, t in tensors.items()}


SINGLE_PARAMETER_KEY = (
    r"base_model\.model\.model\.language_model\.layers\.\d+\.mlp\.experts\.lora_[AB]\.weight"
)


@pytest.mark.slow
def test_e2e_moe_adapters_are_peft_s_own_files_and_load_here(tiny, tmp_path, monkeypatch):
    """--e2e's MoE case (shrunk to SMALL): the adapters on one expert parameter are in
    the layout PEFT writes for one target parameter (<experts>.lora_{A,B} only, no
    base_layer, target_parameters of one entry: the same keys as the fixture's own
    PEFT adapters), and the reference loads them and the full adapter and answers."""
    import re

    needs_peft()
    from patchkit.verify import e2e

    experts = {k: v for k, v in SMALL.items() if k in e2e.MOE_TEXT}
    text = {k: v for k, v in SMALL.items() if k not in experts}
    monkeypatch.setattr(e2e, "TINY_TEXT", {**e2e.TINY_TEXT, **text})
    monkeypatch.setattr(e2e, "MOE_TEXT", {**e2e.MOE_TEXT, **experts})
    model, adapters = e2e.build_moe(tmp_path, 0)
    assert list(adapters) == [e2e.MOE_FULL, *e2e.MOE_PARTIAL_ADAPTERS]
    rows = e2e.EXPERT_RANK * e2e.MOE_TEXT["num_experts"]
    hidden, inter = SMALL["hidden_size"], SMALL["moe_intermediate_size"]
    wanted = {
        "down": ((rows, inter), (hidden, rows)),
        "gate_up": ((rows, hidden), (2 * inter, rows)),
    }
    for name, targets in e2e.MOE_PARTIAL_ADAPTERS.items():
        config = json.loads((adapters[name] / "adapter_config.json").read_text())
        assert config["target_parameters"] == targets and len(targets) == 1
        assert not config["target_modules"]
        shapes = factor_shapes(adapters[name])
        assert set(shapes) == set(factor_shapes(tiny[name]))  # PEFT's own, made by the fixture
        assert all(re.fullmatch(SINGLE_PARAMETER_KEY, key) for key in shapes), sorted(shapes)
        a, b = wanted[name]
        assert {s for k, s in shapes.items() if ".lora_A." in k} == {a}
        assert {s for k, s in shapes.items() if ".lora_B." in k} == {b}
    assert any(".experts.base_layer.lora_A" in k for k in factor_shapes(adapters[e2e.MOE_FULL]))

    asked = {"p40": PROMPTS["p40"]}
    runs = peftref.reference_runs(
        lambda: peftref.load_base(model, None), adapters, asked, peftref.requests(adapters, asked)
    )
    for name in adapters:
        assert not checks.served_error(runs, f"lora:{name}"), runs[f"lora:{name}"]
        assert mean_diff(runs, f"lora:{name}", "base") > 0.02, name
    assert mean_diff(runs, "lora:down", "lora:gate_up") > 0.02
    for name in e2e.MOE_PARTIAL_ADAPTERS:  # unmerged as PEFT merges it: the same projection
        merged = plain_logprobs(model, PROMPTS["p40"], adapters[name])
        assert checks.diff(checks.logprobs(runs, f"lora:{name}", "p40"), merged)[1] < 1e-3
