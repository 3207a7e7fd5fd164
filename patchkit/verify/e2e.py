"""End-to-end check for `patchkit verify --e2e`: a tiny Qwen3.5 hybrid under vLLM with LoRA.

Everything is built locally, nothing is downloaded: a random Qwen3.5 model
(3 Gated DeltaNet layers + 1 attention layer) made with transformers, a
rank-64 PEFT adapter on the attention, GDN and MLP projections, and token-id
prompts of about 50, 600 and 3000 tokens. transformers + PEFT in float32 give
the reference prompt log-probabilities; vLLM serves the same model twice, in
eager mode and with torch.compile + CUDA graphs, each in its own process.

A tiny Qwen3.5-MoE hybrid (8 routed experts, top 2, and a shared expert in
every layer) with an adapter on attention, GDN, the shared expert and the
routed experts (vLLM's fused_moe_lora) is served beside it and checked like
`verify --model`, against the adapter merged into the weights
(patchkit.verify.usermodel; transformers + PEFT where the merged reference
cannot decide). The same engines serve two adapters PEFT saves on one expert
parameter, ``down_proj`` alone and ``gate_up_proj`` alone (vLLM #48460, patch
partial-moe-adapter): each must load, match transformers + PEFT in float32
within 1.5 x the engine's own base error against it, move the output, and be
told apart from the full adapter and from the other one. Every vLLM engine
runs through patchkit.verify.serving, on --tensor-parallel-size GPUs each,
all side by side when they fit; the MoE case's transformers + PEFT reference
runs after them, alone (it takes every GPU).

Random weights make greedy tokens a poor comparison (near-ties diverge), so
the checks compare teacher-forced prompt log-probabilities instead.
torch, transformers, peft and vllm are imported inside functions only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from patchkit.codes import Code, Reason
from patchkit.verify import (
    baserows,
    checks,
    engines,
    modelchecks,
    peftref,
    references,
    serving,
    usermodel,
)
from patchkit.verify.checks import Check

PROMPT_LENGTHS = (50, 600, 3000)
VOCAB = 4096
RANK = 64
TARGET_MODULES = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj"
    r"|gate_proj|up_proj|down_proj)"
)
# Adapters that train one member of the fused GDN in_proj_qkvz only (vLLM
# #47639 / #57851): each is served on one prompt and checked like the full one.
PARTIAL_ADAPTERS = {
    "lora_qkv": r".*language_model.*\.in_proj_qkv",
    "lora_z": r".*language_model.*\.in_proj_z",
}
PARTIAL_PROMPT = "p600"
PARTIAL_EFFECT_MIN = 0.01  # one projection of three GDN layers: a smaller, still clear effect
# Teacher-forced prompt log-probabilities, vLLM (bf16) against transformers
# (float32 from the same bf16 weights): mean and max absolute difference.
LOGPROB_MEAN_TOL = 0.03
LOGPROB_MAX_TOL = 0.3
# LoRA must move the log-probabilities by clearly more than that noise.
LORA_EFFECT_MIN = 0.1  # about a third of the effect the adapter is built with
# The MoE case's engines share served.json with the dense ones: their names start with this.
MOE_PREFIX = "moe-"
__all__ = ["Check", "compare", "run_e2e"]


def prompts(seed: int) -> dict[str, list[int]]:
    """Token-id prompts; ids stay below the image/video special tokens (4090+)."""
    rnd = random.Random(seed)
    return {f"p{n}": [rnd.randrange(1, 4000) for _ in range(n)] for n in PROMPT_LENGTHS}


TINY_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=8192,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)


def qwen35_config(**text):
    """A Qwen3.5 hybrid (transformers' Qwen3_5Config): TINY_TEXT with `text` over it.

    The vision tower is one tiny layer; vLLM serves the text model only
    (language_model_only). Loads in transformers 5.17 and vLLM 0.22-0.26.
    """
    from transformers import Qwen3_5Config

    return _with_vision(Qwen3_5Config, {**TINY_TEXT, **text})


def _with_vision(config_class, text: dict):
    """A Qwen3.5 (or -MoE) config: ``text``, a one-layer vision tower, special ids 4090-4093."""
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
    )
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=4090,
        video_token_id=4091,
        vision_start_token_id=4092,
        vision_end_token_id=4093,
        tie_word_embeddings=False,
    )


def build_model(workdir: Path, seed: int) -> tuple[Path, Path]:
    """Save a random tiny Qwen3.5 hybrid and a random rank-64 adapter under workdir."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    model_dir, adapter_dir = workdir / "model", workdir / "adapter"
    save_random(
        Qwen3_5ForConditionalGeneration,
        qwen35_config(),
        seed,
        model_dir,
        adapter_dir,
        TARGET_MODULES,
    )
    for kind, target in PARTIAL_ADAPTERS.items():
        base = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16)
        config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=target, init_lora_weights=False)
        partial = scale_lora_b(get_peft_model(base, config), 0.3)
        partial.save_pretrained(partial_dir(adapter_dir, kind))
    return model_dir, adapter_dir


def save_random(model_class, config, seed: int, model_dir: Path, adapter_dir: Path, targets):
    """Save a random bf16 model and a random rank-64 PEFT adapter on ``targets``."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    lora = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets, init_lora_weights=False)
    scale_lora_b(get_peft_model(model, lora), 0.3).save_pretrained(adapter_dir)


def scale_lora_b(peft_model, factor: float):
    """Scale PEFT's random lora_B (init_lora_weights=False) so LoRA is visible, logits sane."""
    import torch

    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(factor)
    return peft_model


def partial_dir(adapter_dir: Path, kind: str) -> Path:
    """Where the partial adapter ``kind`` is saved, beside the full one."""
    return adapter_dir.parent / f"adapter-{kind}"


def reference_logprobs(model_dir: Path, adapter_dir: Path, seed: int) -> dict:
    """transformers + PEFT, float32 (patchkit.verify.peftref): per prompt, base and LoRA
    log-probs of tokens 1..n-1, and each partial adapter's on PARTIAL_PROMPT."""
    adapters = {"lora": adapter_dir}
    adapters |= {kind: partial_dir(adapter_dir, kind) for kind in PARTIAL_ADAPTERS}
    asked = prompts(seed)
    plan = [("base", p, None) for p in asked] + [("lora", p, "lora") for p in asked]
    plan += [(kind, PARTIAL_PROMPT, kind) for kind in PARTIAL_ADAPTERS]
    max_memory = peftref.gpu_placement(model_dir, adapters, asked)
    runs = peftref.reference_runs(
        lambda: peftref.load_base(model_dir, max_memory), adapters, asked, plan
    )
    refused = [f"{label}: {group['error']}" for label, group in runs.items() if "error" in group]
    if refused:
        raise peftref.ReferenceFailed(
            f"transformers + PEFT did not load the e2e adapters: {refused[0]}", refused=refused
        )
    return {
        label: {p: request["prompt_logprobs"] for p, request in group.items()}
        for label, group in runs.items()
    }


# ----- the MoE case: attention, GDN, shared expert and routed experts under LoRA -----

MOE_TEXT = dict(
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    num_experts=8,
    num_experts_per_tok=2,
)
MOE_TARGET_MODULES = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj"
    r"|shared_expert\.gate_proj|shared_expert\.up_proj|shared_expert\.down_proj)"
)
MOE_PROMPT_LENGTHS = [600, 3000]


# Qwen3.5-27B's text widths (head sizes as TINY_TEXT's), without a layer count: the
# dense stand-in of the serving benchmark (8 layers) and of the wide verify proof (4).
DENSE27B_WIDTHS = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
)

# Qwen3.5/3.6-35B-A3B's text widths cut to 8 layers (3 GDN : 1 attention, twice; head
# sizes as TINY_TEXT's): the MoE stand-in of the serving benchmark and of the wide
# verify and nan-probe proofs (scripts/), about 6.8 B parameters.
MOE35B_WIDTHS = dict(
    hidden_size=2048,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=16,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
)


def qwen35_moe_config(**text):
    """A Qwen3.5-MoE hybrid (transformers' Qwen3_5MoeConfig): TINY_TEXT with 8 routed
    experts (top 2) and a shared expert in every layer (vLLM's Qwen3NextSparseMoeBlock),
    `text` over it."""
    from transformers import Qwen3_5MoeConfig

    tiny = {k: v for k, v in TINY_TEXT.items() if k != "intermediate_size"}
    return _with_vision(Qwen3_5MoeConfig, tiny | MOE_TEXT | text)


# Adapters on one routed-expert parameter alone, as PEFT saves them: their factors are
# <experts>.lora_{A,B} with no base_layer level, which unpatched vLLM refuses (vLLM
# #48460: `assert gate_up_proj_lora is not None`; patch partial-moe-adapter). Served in
# the MoE LoRA engines beside the full adapter, judged against transformers + PEFT.
MOE_FULL = "moe"
MOE_PARTIAL_ADAPTERS = {
    "down": ["mlp.experts.down_proj"],
    "gate_up": ["mlp.experts.gate_up_proj"],
}
EXPERT_RANK = 16
# served.json's entry of the MoE case's transformers + PEFT reference
MOE_PEFT = MOE_PREFIX + "peft"
UNPATCHED_MOE = (
    "an adapter on one expert parameter does not load where vLLM #48460 is open "
    "(`assert gate_up_proj_lora is not None`): `patchkit apply` carries the fix "
    "(partial-moe-adapter)"
)


def build_moe(workdir: Path, seed: int) -> tuple[Path, dict[str, Path]]:
    """Save a random tiny Qwen3.5-MoE, a rank-64 adapter on attention, GDN and experts,
    and the adapters on one expert parameter (MOE_PARTIAL_ADAPTERS), PEFT's own files.

    The full adapter's linear factors come from PEFT; its routed experts' factors
    are written in the layout PEFT >= 0.20 saves for both ``target_parameters``
    and vLLM's FusedMoE3DWithLoRA reads (``<experts>.base_layer.lora_{A,B}`` is
    gate_up_proj: A (r*E, hidden), B (2*I, r*E); ``<experts>.lora_{A,B}`` is
    down_proj: A (r*E, I), B (hidden, r*E); see docs/verify.md ("The merged reference")),
    so that case does not depend on the PEFT release installed. The partial
    adapters are what PEFT itself saves for one parameter (save_expert_adapter):
    their layout is the point of the case. Returns the model and {name: adapter}.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForConditionalGeneration

    model_dir, adapter_dir = workdir / "moe-model", workdir / "moe-adapter"
    save_random(
        Qwen3_5MoeForConditionalGeneration,
        qwen35_moe_config(),
        seed + 1,
        model_dir,
        adapter_dir,
        MOE_TARGET_MODULES,
    )
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    tensors |= _expert_factors(torch, seed)
    save_file(tensors, adapter_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config_file.write_text(json.dumps(config, indent=2))
    adapters = {MOE_FULL: adapter_dir}
    for number, (name, targets) in enumerate(MOE_PARTIAL_ADAPTERS.items(), start=3):
        torch.manual_seed(seed + number)
        adapters[name] = workdir / f"moe-adapter-{name}"
        save_expert_adapter(model_dir, adapters[name], targets)
    return model_dir, adapters


def save_expert_adapter(
    model_dir: Path, adapter_dir: Path, targets: list[str], rank: int = EXPERT_RANK
) -> None:
    """Save, with PEFT's save_pretrained, an adapter on the routed experts' ``targets``
    (``target_parameters``) of the Qwen3.5-MoE in model_dir, and nothing else.

    With one parameter PEFT writes ``<experts>.lora_{A,B}`` alone and
    ``target_parameters`` of one entry; with both it nests the first under
    ``base_layer``. The factors are random (expert_factors), drawn from torch's
    generator: the caller seeds it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5MoeForConditionalGeneration

    base = Qwen3_5MoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=[], target_parameters=targets,
                        exclude_modules=r".*visual.*")  # fmt: skip
    expert_factors(get_peft_model(base, config), rank).save_pretrained(adapter_dir)


def expert_factors(peft_model, rank: int):
    """Draw a PEFT model's routed-expert factors as _expert_factors does (A (r*E, in) over
    sqrt(in), B (out, r*E) times 0.3 / sqrt(r)), so the experts' LoRA is clearly visible."""
    import torch

    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".experts." in name and "lora_A" in name:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif ".experts." in name and "lora_B" in name:
                param.copy_(torch.randn_like(param) * (0.3 / rank**0.5))
    return peft_model


def _expert_factors(torch, seed: int) -> dict:
    """Random expert factors of every layer, sized so the experts' LoRA is clearly visible."""
    gen = torch.Generator().manual_seed(seed + 2)
    hidden, inter, experts = TINY_TEXT["hidden_size"], MOE_TEXT["moe_intermediate_size"], 8
    out = {}
    for layer in range(TINY_TEXT["num_hidden_layers"]):
        root = f"base_model.model.model.language_model.layers.{layer}.mlp.experts"
        for wrapper, d_out, d_in in (
            (root + ".base_layer", 2 * inter, hidden),
            (root, hidden, inter),
        ):
            a = torch.randn(RANK * experts, d_in, generator=gen) / d_in**0.5
            b = torch.randn(d_out, RANK * experts, generator=gen) * (0.3 / RANK**0.5)
            out[f"{wrapper}.lora_A.weight"] = a.to(torch.bfloat16)
            out[f"{wrapper}.lora_B.weight"] = b.to(torch.bfloat16)
    return out


# ----- serving: every engine of the run at once -----


def dense_jobs(model_dir: Path, adapter_dir: Path, seed: int, memory: dict) -> list:
    """The dense model with the full and both partial adapters, in each mode, and
    without LoRA in each mode (baserows)."""
    loras = {"full": str(adapter_dir)}
    loras |= {kind: str(partial_dir(adapter_dir, kind)) for kind in PARTIAL_ADAPTERS}
    requests = [(label, name, "full" if label.startswith("lora") else None) for label, name in PLAN]
    # Last: an adapter that does not load must not hide the other results.
    requests += [(kind, PARTIAL_PROMPT, kind) for kind in PARTIAL_ADAPTERS]
    return [
        serving.Job(
            name=engine.name,
            model=str(model_dir),
            mode=engine.mode,
            prompts=prompts(seed),
            requests=requests,
            loras=loras,
            max_lora_rank=RANK,
            max_model_len=4096,
            seed=seed,
            **memory,
        )
        for engine in engines.lora_engines()
    ] + baserows.jobs(
        str(model_dir), prompts(seed), {"max_model_len": 4096, "seed": seed, **memory}
    )


@dataclass(frozen=True)
class MoeCase:
    """The MoE case's files and prompts: what its engines and its PEFT reference serve."""

    model: Path
    adapters: dict[str, Path]  # MOE_FULL first (lora_after_long uses it), then the partials
    prompts: dict[str, list[int]]


def moe_case(workdir: Path, seed: int) -> MoeCase:
    """Build the MoE model and its adapters (build_moe) and draw its prompts."""
    model, adapters = build_moe(workdir, seed)
    config = usermodel.read_config(model)
    return MoeCase(model, adapters, usermodel.make_prompts(config, MOE_PROMPT_LENGTHS, seed))


def moe_jobs(case: MoeCase, workdir: Path, seed: int, memory: dict, say) -> list:
    """The MoE model with every adapter in each mode, the full adapter's merged
    reference and rounding control, and the engines without LoRA (engines.jobs).
    The partial adapters have no merged reference: transformers + PEFT judges them."""
    full = {MOE_FULL: case.adapters[MOE_FULL]}
    plans = references.plan_references(case.model, full, workdir, say)
    written = references.write_references(plans, workdir, say, seed)
    setup = {"prompts": case.prompts, "max_model_len": 4096, "seed": seed, **memory}
    jobs = engines.jobs(case.model, case.adapters, written, setup, prefix=MOE_PREFIX)
    return [partial_requests_last(job) for job in jobs]


def partial_requests_last(job: serving.Job) -> serving.Job:
    """The job with the partial adapters' requests moved to its end: where one does not
    load (unpatched vLLM), the engine dies on it, and a base request after it would
    take every other answer of the engine with it."""
    partial = [r for r in job.requests if r[2] in MOE_PARTIAL_ADAPTERS]
    rest = [r for r in job.requests if r[2] not in MOE_PARTIAL_ADAPTERS]
    return replace(job, requests=rest + partial)


def moe_peft_reference(case: MoeCase, served: dict, workdir: Path, timeout: float, say) -> dict:
    """transformers + PEFT in float32 (patchkit.verify.peftref) on the MoE case, in a
    child of its own after every vLLM engine (it takes every GPU): the partial adapters,
    and the full one where its merged reference cannot decide (usermodel's choice).
    Its result, in a served engine's form, or {"error": ...}."""
    _, need = usermodel.choose_references(served, [MOE_FULL], {}, None, MOE_PREFIX)
    names = [*MOE_PARTIAL_ADAPTERS, *need]
    say(f"PEFT reference (transformers + PEFT, float32) for the MoE case: {', '.join(names)}")
    job = peftref.job(case.model, {n: case.adapters[n] for n in names}, case.prompts, MOE_PEFT)
    return serving.alone(job, workdir, timeout)


def engine_memory(model_dir: Path, tp: int, gpu: tuple[int, int]) -> tuple[dict, int]:
    """Each e2e engine's memory settings, and how many fit side by side."""
    total, free = gpu
    kv = 2 * serving.GIB
    size = usermodel.weight_bytes(model_dir) * 3  # the MoE model is about three times larger
    fraction = serving.engine_memory(size, VOCAB, tp, kv, total)
    memory = {"tensor_parallel_size": tp, "gpu_memory_utilization": fraction, "kv_cache_bytes": kv}
    return memory, serving.side_by_side(fraction, 0.9 * free / total)


def run_e2e(
    workdir: Path,
    seed: int,
    tp: int = 1,
    gpu: tuple[int, int] = (1, 1),
    say=lambda line: None,
    timeout: float = 540.0,
) -> list[Check]:
    """Build, reference, serve every engine (dense and MoE, both modes), compare."""
    model_dir, adapter_dir = build_model(workdir, seed)
    # The reference runs first and keeps its memory until the end.
    reference = reference_logprobs(model_dir, adapter_dir, seed)
    (workdir / "reference.json").write_text(json.dumps(reference))
    memory, at_once = engine_memory(model_dir, tp, gpu)
    jobs = dense_jobs(model_dir, adapter_dir, seed, memory)
    case = moe_case(workdir, seed)
    jobs += moe_jobs(case, workdir, seed, memory, say)
    say(
        f"serving the e2e models: {len(jobs)} engines, {at_once} at a time, TP={tp}; "
        "then the MoE case's transformers + PEFT reference alone"
    )
    served = serving.serve_all(jobs, workdir, timeout, at_once)
    served[MOE_PEFT] = moe_peft_reference(case, served, workdir, timeout, say)
    (workdir / "served.json").write_text(json.dumps(served))
    loras = engines.Served.from_json(served, []).lora()
    dense = [check for lora in loras for check in compare(lora.engine.mode, lora.result, reference)]
    dense += baserows.base_rows_checks(served, {e.engine.mode: e.engine.name for e in loras})
    return dense + moe_checks(served, say)  # baserows included


# ----- the checks of the MoE case -----

PARTIAL_WHY = Reason.of(Code.VERIFY_PARTIAL_PEFT)  # one expert parameter: no merged reference


def moe_references(served: dict) -> dict[str, references.Reference]:
    """Each MoE adapter's reference: the full adapter's merged one where it decides, else
    transformers + PEFT (usermodel.choose_references, as `verify --model` chooses); the
    partial adapters' transformers + PEFT (served[MOE_PEFT])."""
    chosen, need = usermodel.choose_references(served, [MOE_FULL], {}, None, MOE_PREFIX)
    run = engines.Served.from_json(served, [MOE_FULL], MOE_PREFIX)
    run.peft = served.get(MOE_PEFT)
    for name in need:
        chosen[name] = references.peft_or_merged(run, name, chosen[name])
    for name in MOE_PARTIAL_ADAPTERS:
        chosen[name] = references.peft_reference(run, name, PARTIAL_WHY)
    return chosen


def moe_checks(served: dict, say=lambda line: None) -> list[Check]:
    """The MoE case's checks: the full adapter, the engines and base rows as `verify
    --model` judges them (modelchecks.compare), then each partial adapter in each mode."""
    chosen = moe_references(served)
    for name, reference in chosen.items():
        say(Reason.of(Code.VERIFY_MOE_REFERENCE, adapter=name, reference=reference.kind,
                      why=reference.why))  # fmt: skip
    full = {MOE_FULL: chosen[MOE_FULL]}
    out = [
        _named_bug(c) for c in modelchecks.compare(served, [MOE_FULL], MOE_PREFIX, references=full)
    ]
    for lora in engines.Served.from_json(served, [], MOE_PREFIX).lora():
        if "error" in lora.result:  # compare reported it ("vLLM ran")
            continue
        for name in MOE_PARTIAL_ADAPTERS:
            out += partial_moe_checks(lora, name, chosen[name])
    return out


def _named_bug(check: Check) -> Check:
    """An engine that died of the bug as a whole (its log's first error is the assert,
    not one request's) says so too."""
    if check.ok or "gate_up_proj_lora" not in check.detail:
        return check
    return Check(check.name, False, f"{check.detail}; {UNPATCHED_MOE}", check.adapter)


@dataclass(frozen=True)
class Other:
    """Another adapter's answers as a control of a partial one (what
    modelchecks.control_check reads): the partial adapter's bound must reject the full
    adapter's answers and the other partial's, or the run could not tell the projection
    it trains from the other one (down_proj from gate_up_proj) or from both."""

    adapter: str  # the partial adapter judged
    other: str  # the adapter whose answers stand in

    @property
    def what(self) -> str:
        return f"served as {self.other}"

    @property
    def label(self) -> str:
        return f"lora:{self.other}"


def partial_moe_checks(lora: engines.EngineServed, name: str, reference) -> list[Check]:
    """One partial expert adapter in one LoRA engine, by modelchecks.adapter_checks against
    transformers + PEFT (bound 1.5 x |vLLM base - PEFT base| of this engine): served,
    finite, within the bound, moving the output, and told apart from the full adapter
    and the other partial one. Not served: the row names the bug and the fix."""
    others = [Other(name, o) for o in (MOE_FULL, *MOE_PARTIAL_ADAPTERS) if o != name]
    engine = lora.engine.name
    found = modelchecks.adapter_checks(
        engine, name, lora.runs, reference, reference.floors.get(engine), others
    )
    served = f"{engine}: {name} adapter served"
    return [
        Check(c.name, c.ok, f"{c.detail}; {UNPATCHED_MOE}", c.adapter, c.decided)
        if c.name == served and not c.ok
        else c
        for c in found
    ]


# ----- the checks of the dense case, against transformers + PEFT -----

# The requests of one dense engine, in order: (label, prompt). LoRA labels use the adapter.
PLAN = (
    ("base", "p50"),
    ("base", "p600"),
    ("base", "p3000"),
    ("lora", "p50"),
    ("lora", "p600"),
    ("lora", "p3000"),
    ("lora_after_long", "p50"),
    ("base_after_lora", "p50"),
    ("base_after_lora", "p600"),
    ("base_after_lora", "p3000"),
)


def compare(mode: str, served: dict, reference: dict) -> list[Check]:
    """The e2e checks for one mode."""
    ran = checks.engine_ran(mode, served)
    if "error" in served:
        return ran
    runs = served["runs"]
    return [
        *ran,
        *checks.health_checks(mode, served),
        *_reference_checks(mode, runs, reference),
        _effect_check(mode, runs),
        checks.repeat_check(
            mode, runs, "base_after_lora", "base", "base after LoRA equals base before"
        ),
        *_partial_checks(mode, runs, reference),
        checks.repeat_check(
            mode, runs, "lora_after_long", "lora", "short prompt after a long one unaffected"
        ),
    ]


BOUNDS = (LOGPROB_MEAN_TOL, LOGPROB_MAX_TOL)


def _reference_checks(mode: str, runs: dict, reference: dict) -> list[Check]:
    """Base and LoRA prompt log-probabilities within bounds of transformers + PEFT."""
    return [
        checks.bound_check(
            f"{mode}: {kind} {name[1:]} tokens vs transformers",
            checks.logprobs(runs, kind, name),
            reference[kind][name],
            BOUNDS,
        )
        for kind in ("base", "lora")
        for name in reference[kind]
    ]


def _effect_check(mode: str, runs: dict) -> Check:
    """The adapter visibly changes the output (it was applied at all)."""
    error = checks.served_error(runs, "lora")
    if error:
        why = f"not served: {error}"
        return Check(f"{mode}: LoRA output differs from base", False, why, served=False)
    effect = min(
        checks.diff(checks.logprobs(runs, "lora", n), checks.logprobs(runs, "base", n))[0]
        for n in runs["lora"]
    )
    return Check(
        f"{mode}: LoRA output differs from base",
        effect >= LORA_EFFECT_MIN,
        f"smallest mean |LoRA - base| {effect:.4f} (>= {LORA_EFFECT_MIN})",
    )


def _partial_checks(mode: str, runs: dict, reference: dict) -> list[Check]:
    """Each partial GDN adapter: it loads, matches transformers + PEFT, and changes the output."""
    out = []
    for kind in PARTIAL_ADAPTERS:
        error = checks.served_error(runs, kind)
        if error:
            out.append(Check(f"{mode}: {kind} adapter served", False, error))
            continue
        values = checks.logprobs(runs, kind, PARTIAL_PROMPT)
        out.append(
            checks.bound_check(
                f"{mode}: {kind} adapter vs transformers",
                values,
                reference[kind][PARTIAL_PROMPT],
                BOUNDS,
            )
        )
        effect = checks.diff(values, checks.logprobs(runs, "base", PARTIAL_PROMPT))[0]
        out.append(
            Check(
                f"{mode}: {kind} adapter differs from base",
                effect >= PARTIAL_EFFECT_MIN,
                f"mean |LoRA - base| {effect:.4f} (>= {PARTIAL_EFFECT_MIN})",
            )
        )
    return out
