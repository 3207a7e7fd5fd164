"""Base rows stay base: a LoRA-enabled engine answers base requests as an engine without LoRA.

With ``--enable-lora`` vLLM wraps every targeted layer (and, in a MoE model,
the routed experts) in a LoRA layer, also for requests that name no adapter.
Those must come out as the model alone answers them: upstream vLLM #49063
reports base requests that loop on Qwen3.6-35B-A3B once LoRA is enabled. So
beside the LoRA engines, each run serves the base prompts on two engines
without LoRA (eager and CUDA graphs, named PREFIX+nolora-MODE), and the
LoRA engine's base requests of each mode are checked against the engine
without LoRA of the same mode.

Bit-identical where the LoRA path adds exact zeros for base rows: patchkit's
torch path (matmul-add-lora-linear; the served result says
``lora_backend: torch``) skips a batch without LoRA altogether and masks base
rows with a slot weight of 0 (an exact 0 added), and the base GEMMs are the
same calls, so in eager mode on a model without routed experts nothing may
differ by a bit. Elsewhere equality is reported but not required, and the
answers must agree within a bound measured in the run: CUDA-graph mode
compiles the LoRA engine's graph around the LoRA ops (other fusions, other
rounding), and a MoE model's LoRA wrapper runs the experts through the fused
MoE LoRA kernel path, not the no-LoRA one. The measure is how far the two
engines without LoRA (eager and CUDA graphs: the same weights, two valid
kernel choices) answer apart, taken over all prompts; the LoRA engine's base
rows may differ from their mode's engine without LoRA by BOUND_FACTOR times
that, never less than FLOOR, the max never more than MAX_CEILING (the rule's,
patchkit.verify.rule: a near-tied routing flip moves one token by up to ~1.4 nats). A base
row that takes an adapter's delta (a stale slot: 1.59 nats seen once on the
H200) or loops moves the answer by about an adapter's effect (0.3-0.6 mean
in these runs), far past kernel noise.

Recorded runs from before these engines (tests/data) have none: the check
then has nothing to compare and adds no row.
"""

from __future__ import annotations

from patchkit.verify import checks, serving
from patchkit.verify.checks import Check
from patchkit.verify.rule import MAX_CEILING  # one ceiling, for the same routing flips

TITLE = "base requests of the LoRA engine equal an engine without LoRA"
# (mean, max) |d logprob| always allowed: run-to-run noise (checks.REPEAT_MAX_TOL)
# for the max, a fifth of that for the mean.
FLOOR = (0.01, checks.REPEAT_MAX_TOL)
# Allowed: this many times the distance between the two engines without LoRA
# (as rule.ROUNDING_FACTOR does for the merged reference's rounding control).
BOUND_FACTOR = 1.5


def engine_names(prefix: str = "") -> dict[str, str]:
    """The engines without LoRA of a run, by mode: PREFIX+nolora-MODE."""
    return {mode: f"{prefix}nolora-{mode}" for mode in serving.MODES}


def jobs(model: str, prompts: dict, common: dict, prefix: str = "") -> list[serving.Job]:
    """An engine without LoRA per mode, serving every prompt as a base request.

    ``common``: the run's tensor_parallel_size, max_model_len, seed,
    gpu_memory_utilization and kv_cache_bytes (those of its LoRA engines).
    """
    requests = [("base", p, None) for p in prompts]
    return [
        serving.Job(
            name=name, model=str(model), mode=mode, prompts=prompts, requests=requests, **common
        )  # fmt: skip
        for mode, name in engine_names(prefix).items()
    ]


def exact_expected(lora_result: dict, mode: str) -> bool:
    """Whether the LoRA path adds exact zeros for base rows here: patchkit's torch path,
    eager mode, no routed experts (what the LoRA engine's result says it ran)."""
    return (
        lora_result.get("lora_backend") == "torch"
        and lora_result.get("routed_experts") == 0
        and mode == "eager"
    )


def control(served: dict, prefix: str = "") -> tuple[float, float] | None:
    """(mean, max) |eager - CUDA graphs| of the engines without LoRA over all prompts
    (the largest of each); None when either did not answer every prompt finitely."""
    eager, graphs = (
        served.get(name, {}).get("runs", {}).get("base") for name in engine_names(prefix).values()
    )
    if not eager or not graphs or "error" in eager or "error" in graphs:
        return None
    found = [
        checks.diff(checks.logprobs({"b": eager}, "b", p), checks.logprobs({"b": graphs}, "b", p))
        for p in eager
    ]
    if not found or any(d[0] == float("inf") for d in found):
        return None
    return max(d[0] for d in found), max(d[1] for d in found)


def bounds(measured: tuple[float, float] | None) -> tuple[float, float]:
    """FLOOR, widened to BOUND_FACTOR x the measured distance, the max at most MAX_CEILING."""
    if measured is None:
        return FLOOR
    return (
        max(FLOOR[0], round(BOUND_FACTOR * measured[0], 4)),
        min(MAX_CEILING, max(FLOOR[1], round(BOUND_FACTOR * measured[1], 3))),
    )


def base_rows_checks(served: dict, lora_names: dict[str, str], prefix: str = "") -> list[Check]:
    """The engines without LoRA ran, and each LoRA engine's base requests (``lora_names``:
    mode -> engine name) equal its mode's engine without LoRA: bit for bit where
    exact_expected, else within bounds(control). [] for a run recorded without them."""
    names = engine_names(prefix)
    if not any(name in served for name in names.values()):
        return []
    out: list[Check] = []
    for name in names.values():
        result = served.get(name, {"error": "not served"})
        out += checks.engine_ran(name, result)
        if "error" not in result:
            out += checks.health_checks(name, result)
    limit = bounds(control(served, prefix))
    for mode, lora_name in lora_names.items():
        lora = served.get(lora_name, {"error": "not served"})
        plain = served.get(names[mode], {"error": "not served"})
        out.append(compare_mode(lora_name, mode, lora, plain, limit))
    return out


def compare_mode(name: str, mode: str, lora: dict, plain: dict, limit) -> Check:
    """One LoRA engine's base requests against the engine without LoRA of its mode."""
    title = f"{name}: {TITLE}"
    missing = lora.get("error") or plain.get("error")
    lora_base = lora.get("runs", {}).get("base") or {"error": "no base requests"}
    plain_base = plain.get("runs", {}).get("base") or {"error": "no base requests"}
    missing = missing or lora_base.get("error") or plain_base.get("error")
    if missing:
        return Check(title, False, f"not served: {missing}", served=False)
    prompts = list(plain_base)
    found = [checks.diff(checks.logprobs({"b": lora_base}, "b", p),
                         checks.logprobs({"b": plain_base}, "b", p)) for p in prompts]  # fmt: skip
    mean, worst = max(d[0] for d in found), max(d[1] for d in found)
    identical = all(lora_base.get(p) == plain_base.get(p) for p in prompts)
    if exact_expected(lora, mode):
        detail = (
            f"bit-identical: {identical} (required: patchkit's torch path adds exact zeros "
            f"for base rows, eager, no routed experts); max |d logprob| {worst:.2e}"
        )
        return Check(title, identical, detail)
    mean_tol, max_tol = limit
    why = (
        f"backend {lora.get('lora_backend', 'unknown')}, {mode}, "
        f"{lora.get('routed_experts', 'unknown')} routed experts"
    )
    detail = (
        f"mean |d logprob| {mean:.4f} (<= {mean_tol}), max {worst:.3f} (<= {max_tol}); "
        f"bit-identical: {identical} (not required: {why}); the bound is "
        f"{BOUND_FACTOR}x eager vs CUDA graphs without LoRA"
    )
    return Check(title, mean <= mean_tol and worst <= max_tol, detail)
