"""End-to-end check for `patchkit verify --e2e`: a tiny Qwen3.5 hybrid under vLLM with LoRA.

Everything is built locally, nothing is downloaded: a random Qwen3.5 model
(3 Gated DeltaNet layers + 1 attention layer) made with transformers, a
rank-64 PEFT adapter on the attention, GDN and MLP projections, and token-id
prompts of about 50, 600 and 3000 tokens. transformers + PEFT in float32 give
the reference prompt log-probabilities; vLLM serves the same model twice, in
eager mode and with torch.compile + CUDA graphs, each in its own process
(they start in parallel to stay inside the time budget).

Random weights make greedy tokens a poor comparison (near-ties diverge), so
the checks compare teacher-forced prompt log-probabilities instead.
torch, transformers, peft and vllm are imported inside functions only.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from patchkit.symptoms import longest_zero_run

PROMPT_LENGTHS = (50, 600, 3000)
VOCAB = 4096
RANK = 64
GENERATED = 16
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
# The same request twice (before/after other requests) must agree within
# run-to-run noise: the Triton shrink kernel sums split-k partials with
# atomic adds (order not fixed), which moved a 50-token prompt's log-probs by
# up to 8e-3 on the test H200. Carried-over GDN state or a stale adapter slot
# moves them by about the LoRA effect (0.3 here).
REPEAT_MAX_TOL = 0.05
# A run of this many token-id-0 tokens is the "!!!!" symptom.
ZERO_RUN = 3
MODES = ("eager", "cudagraph")


@dataclass
class Check:
    """One named pass/fail with the number that decided it."""

    name: str
    ok: bool
    detail: str


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

    text = {**TINY_TEXT, **text}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=text["hidden_size"])  # fmt: skip
    return Qwen3_5Config(
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

    torch.manual_seed(seed)
    config = qwen35_config()
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model_dir, adapter_dir = workdir / "model", workdir / "adapter"
    model.save_pretrained(model_dir)
    lora = LoraConfig(
        r=RANK, lora_alpha=RANK, target_modules=TARGET_MODULES, init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # random but moderate: LoRA visible, logits sane
                param.mul_(0.3)
    peft_model.save_pretrained(adapter_dir)
    for kind, target in PARTIAL_ADAPTERS.items():
        base = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16)
        config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=target, init_lora_weights=False)
        partial = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in partial.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.3)
        partial.save_pretrained(partial_dir(adapter_dir, kind))
    return model_dir, adapter_dir


def partial_dir(adapter_dir: Path, kind: str) -> Path:
    """Where the partial adapter ``kind`` is saved, beside the full one."""
    return adapter_dir.parent / f"adapter-{kind}"


def reference_logprobs(model_dir: Path, adapter_dir: Path, seed: int, device: str) -> dict:
    """transformers + PEFT, float32: per prompt, base and LoRA log-probs of tokens 1..n-1."""
    import torch
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device).eval()
    out: dict = {"base": {}, "lora": {}}
    with torch.no_grad():
        for name, ids in prompts(seed).items():
            out["base"][name] = _token_logprobs(model, ids, device)
        peft_model = PeftModel.from_pretrained(model, adapter_dir).to(device).eval()
        for name, ids in prompts(seed).items():
            out["lora"][name] = _token_logprobs(peft_model, ids, device)
        for kind in PARTIAL_ADAPTERS:  # each on a fresh base: PEFT wraps the model in place
            base = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
            partial = PeftModel.from_pretrained(base, partial_dir(adapter_dir, kind))
            partial.to(device).eval()
            ids = prompts(seed)[PARTIAL_PROMPT]
            out[kind] = {PARTIAL_PROMPT: _token_logprobs(partial, ids, device)}
            del base, partial
    del model
    return out


def _token_logprobs(model, ids: list[int], device: str) -> list[float]:
    import torch

    tokens = torch.tensor([ids], device=device)
    logits = model(input_ids=tokens).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, tokens[0, 1:, None]).squeeze(1).tolist()


# ----- the vLLM side, run in a child process per mode -----


# The requests of one engine, in order: (label, prompt). LoRA labels use the adapter.
PLAN = (
    ("base", "p50"), ("base", "p600"), ("base", "p3000"),
    ("lora", "p50"), ("lora", "p600"), ("lora", "p3000"),
    ("lora_after_long", "p50"),
    ("base_after_lora", "p50"), ("base_after_lora", "p600"), ("base_after_lora", "p3000"),
)  # fmt: skip


def serve(model_dir: Path, adapter_dir: Path, seed: int, mode: str, out_file: Path) -> None:
    """Run every request of the e2e plan through vllm.LLM and write what came back."""
    started = time.monotonic()
    llm = _engine(model_dir, seed, mode)
    engine_seconds = time.monotonic() - started
    runs = _run_plan(llm, adapter_dir, seed)
    result = {"mode": mode, "engine_seconds": engine_seconds,
              "corrupted_requests": _corrupted(llm), "runs": runs}  # fmt: skip
    out_file.write_text(json.dumps(result))


def _engine(model_dir: Path, seed: int, mode: str):
    """vllm.LLM on the tiny model, with the kernels that need no FlashInfer or DeepGEMM."""
    os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
    import importlib.util

    from vllm import LLM

    extra = {}
    if importlib.util.find_spec("flashinfer") is None:  # pick kernels that need no FlashInfer
        extra = {"attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton"}
        # 0.22's sampler imports FlashInfer unless told not to (seen on the test H200).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if importlib.util.find_spec("deep_gemm") is None:
        # 0.22 warms DeepGEMM up at start and stops if it is missing; the test
        # model is bf16 and never uses it (seen on the test H200).
        os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    return LLM(
        model=str(model_dir), enable_lora=True, max_lora_rank=RANK, max_loras=2,
        enforce_eager=(mode == "eager"), skip_tokenizer_init=True, language_model_only=True,
        gpu_memory_utilization=0.3, max_model_len=4096, max_num_seqs=4,
        max_num_batched_tokens=4096, dtype="bfloat16", seed=seed, disable_log_stats=False,
        **extra,
    )  # fmt: skip


def _run_plan(llm, adapter_dir: Path, seed: int) -> dict:
    """PLAN's requests, then each partial adapter once (last: they may not load)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, prompt_logprobs=0, logprobs=0)
    lora = LoRARequest("patchkit-e2e", 1, str(adapter_dir))
    texts = prompts(seed)

    def run(name: str, adapter) -> dict:
        [result] = llm.generate(
            [{"prompt_token_ids": texts[name]}], params, lora_request=adapter, use_tqdm=False
        )
        return _collect(result, texts[name])

    runs: dict = {}
    for label, name in PLAN:
        runs.setdefault(label, {})[name] = run(name, lora if label.startswith("lora") else None)
    for number, kind in enumerate(PARTIAL_ADAPTERS, start=2):
        request = LoRARequest(f"patchkit-e2e-{kind}", number, str(partial_dir(adapter_dir, kind)))
        try:
            runs[kind] = {PARTIAL_PROMPT: run(PARTIAL_PROMPT, request)}
        except Exception as exc:  # the bug this checks: the adapter does not load
            runs[kind] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return runs


def _corrupted(llm) -> float:
    """vllm:corrupted_requests, summed over engines (VLLM_COMPUTE_NANS_IN_LOGITS=1)."""
    return sum(
        getattr(m, "value", 0) or 0
        for m in llm.get_metrics()
        if m.name.startswith("vllm:corrupted_requests")
    )


def _collect(result, ids: list[int]) -> dict:
    """Prompt log-probs of the actual prompt tokens, generated tokens and their log-probs."""
    prompt = [
        entry[tok].logprob for entry, tok in zip(result.prompt_logprobs[1:], ids[1:], strict=True)
    ]
    completion = result.outputs[0]
    sampled = [
        entry[tok].logprob
        for entry, tok in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return {
        "prompt_logprobs": prompt,
        "tokens": list(completion.token_ids),
        "token_logprobs": sampled,
    }


def start_servers(
    model_dir: Path, adapter_dir: Path, seed: int, workdir: Path, modes=MODES
) -> dict:
    """Start one child process per mode; they share the GPU and start in parallel."""
    children = {}
    for mode in modes:
        with (workdir / f"vllm-{mode}.log").open("w") as log:  # the child keeps its own copy
            children[mode] = _start_one(model_dir, adapter_dir, seed, workdir, mode, log)
    return children


def _start_one(model_dir: Path, adapter_dir: Path, seed: int, workdir: Path, mode: str, log):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "patchkit.proof.e2e",
            str(model_dir),
            str(adapter_dir),
            str(seed),
            mode,
            str(workdir / f"vllm-{mode}.json"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_servers(children: dict, workdir: Path, timeout: float) -> dict:
    """Each mode's results, or an error quoting its log's first error line."""
    deadline = time.monotonic() + timeout
    results = {}
    for mode, child in children.items():
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        out = workdir / f"vllm-{mode}.json"
        if child.returncode == 0 and out.exists():
            results[mode] = json.loads(out.read_text())
        else:
            results[mode] = {
                "error": f"vLLM ({mode}) exited {child.returncode}: "
                + _first_error(workdir / f"vllm-{mode}.log")
            }
    return results


def _first_error(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    errors = [line.strip() for line in lines if "Error" in line and "Traceback" not in line]
    return (errors[0] if errors else " | ".join(lines[-3:]))[:300]


def serve_all(model_dir: Path, adapter_dir: Path, seed: int, workdir: Path, timeout: float) -> dict:
    """Both modes in parallel; a mode that failed then gets one run on its own.

    Two engines starting side by side on one GPU can trip vLLM's memory
    profiling (it fails when another process frees memory meanwhile); alone,
    that cannot happen. The first error is kept in the result.
    """
    served = wait_servers(start_servers(model_dir, adapter_dir, seed, workdir), workdir, timeout)
    for mode in [m for m in MODES if "error" in served[m]]:
        first = served[mode]["error"]
        alone = start_servers(model_dir, adapter_dir, seed, workdir, modes=(mode,))
        served[mode] = wait_servers(alone, workdir, timeout)[mode]
        served[mode]["first_attempt"] = first
    return served


def run_e2e(workdir: Path, seed: int, timeout: float = 420.0) -> list[Check]:
    """Build, reference, serve in both modes, compare; the checks of both modes."""
    model_dir, adapter_dir = build_model(workdir, seed)
    # The reference runs first and keeps its memory until the end: vLLM's
    # memory profiling fails if another process frees GPU memory meanwhile.
    reference = reference_logprobs(model_dir, adapter_dir, seed, "cuda")
    served = serve_all(model_dir, adapter_dir, seed, workdir, timeout)
    return [check for mode in MODES for check in compare(mode, served[mode], reference)]


def compare(mode: str, served: dict, reference: dict) -> list[Check]:
    """The e2e checks for one mode."""
    if "error" in served:
        return [Check(f"{mode}: vLLM ran", False, served["error"])]
    runs = served["runs"]
    return [
        *_health_checks(mode, served, runs),
        *_reference_checks(mode, runs, reference),
        _effect_check(mode, runs),
        _repeat_check(mode, runs, "base_after_lora", "base", "base after LoRA equals base before"),
        *_partial_checks(mode, runs, reference),
        _repeat_check(mode, runs, "lora_after_long", "lora",
                      "short prompt after a long one unaffected"),
    ]  # fmt: skip


def _health_checks(mode: str, served: dict, runs: dict) -> list[Check]:
    """The engine ran; no NaN counted, none in the log-probabilities, no run of token 0."""
    checks = []
    if "first_attempt" in served:
        checks.append(
            Check(f"{mode}: engine started (second attempt, alone)", True, served["first_attempt"])
        )
    corrupted = served["corrupted_requests"]
    checks.append(Check(f"{mode}: vllm:corrupted_requests", corrupted == 0,
                        f"{corrupted} (VLLM_COMPUTE_NANS_IN_LOGITS=1)"))  # fmt: skip
    every = [r for group in runs.values() for r in group.values() if isinstance(r, dict)]
    nan = sum(_count_nan(r["prompt_logprobs"] + r["token_logprobs"]) for r in every)
    checks.append(Check(f"{mode}: no NaN log-probabilities", nan == 0, f"{nan} NaN"))
    zero_runs = [len(r["tokens"]) for r in every if longest_zero_run(r["tokens"]) >= ZERO_RUN]
    checks.append(Check(f"{mode}: no run of token id 0", not zero_runs,
                        f"{len(zero_runs)} outputs with >= {ZERO_RUN} zeros in a row"))  # fmt: skip
    return checks


def _reference_checks(mode: str, runs: dict, reference: dict) -> list[Check]:
    """Base and LoRA prompt log-probabilities within bounds of transformers + PEFT."""
    checks = []
    for kind in ("base", "lora"):
        for name in reference[kind]:
            mean, worst = _diff(runs[kind][name]["prompt_logprobs"], reference[kind][name])
            checks.append(Check(
                f"{mode}: {kind} {name[1:]} tokens vs transformers",
                mean <= LOGPROB_MEAN_TOL and worst <= LOGPROB_MAX_TOL,
                f"mean |d logprob| {mean:.4f} (<= {LOGPROB_MEAN_TOL}), max {worst:.3f} "
                f"(<= {LOGPROB_MAX_TOL})",
            ))  # fmt: skip
    return checks


def _effect_check(mode: str, runs: dict) -> Check:
    """The adapter visibly changes the output (it was applied at all)."""
    effect = min(
        _diff(runs["lora"][n]["prompt_logprobs"], runs["base"][n]["prompt_logprobs"])[0]
        for n in runs["lora"]
    )
    return Check(f"{mode}: LoRA output differs from base", effect >= LORA_EFFECT_MIN,
                 f"smallest mean |LoRA - base| {effect:.4f} (>= {LORA_EFFECT_MIN})")  # fmt: skip


def _repeat_check(mode: str, runs: dict, again: str, first: str, title: str) -> Check:
    """The same request later in the run answers as it did first (no state carried over)."""
    names = list(runs[again])
    worst = max(
        _diff(runs[again][n]["prompt_logprobs"], runs[first][n]["prompt_logprobs"])[1]
        for n in names
    )
    same_tokens = all(runs[again][n]["tokens"] == runs[first][n]["tokens"] for n in names)
    return Check(f"{mode}: {title}", worst <= REPEAT_MAX_TOL and same_tokens,
                 f"max |d logprob| {worst:.2e} (<= {REPEAT_MAX_TOL}), "
                 f"tokens equal: {same_tokens}")  # fmt: skip


def _partial_checks(mode: str, runs: dict, reference: dict) -> list[Check]:
    """Each partial GDN adapter: it loads, matches transformers + PEFT, and changes the output."""
    checks = []
    for kind in PARTIAL_ADAPTERS:
        served = runs.get(kind, {"error": "not run"})
        if "error" in served:
            checks.append(Check(f"{mode}: {kind} adapter served", False, served["error"]))
            continue
        values = served[PARTIAL_PROMPT]["prompt_logprobs"]
        mean, worst = _diff(values, reference[kind][PARTIAL_PROMPT])
        checks.append(
            Check(
                f"{mode}: {kind} adapter vs transformers",
                mean <= LOGPROB_MEAN_TOL and worst <= LOGPROB_MAX_TOL,
                f"mean |d logprob| {mean:.4f} (<= {LOGPROB_MEAN_TOL}), max {worst:.3f} "
                f"(<= {LOGPROB_MAX_TOL})",
            )
        )
        effect = _diff(values, runs["base"][PARTIAL_PROMPT]["prompt_logprobs"])[0]
        checks.append(
            Check(
                f"{mode}: {kind} adapter differs from base",
                effect >= PARTIAL_EFFECT_MIN,
                f"mean |LoRA - base| {effect:.4f} (>= {PARTIAL_EFFECT_MIN})",
            )
        )
    return checks


def _count_nan(values: list[float]) -> int:
    return sum(1 for v in values if v != v)


def _diff(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and max absolute difference (inf when lengths differ or a value is NaN)."""
    if len(a) != len(b) or not a:
        return float("inf"), float("inf")
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    if any(d != d for d in diffs):
        return float("inf"), float("inf")
    return sum(diffs) / len(diffs), max(diffs)


if __name__ == "__main__":  # the child process of start_servers
    serve(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
