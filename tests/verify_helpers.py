"""Served results for the verify tests: what vLLM (and the PEFT reference) would answer.

A served result is serving.collect's form per request, grouped as served.json
holds them ({engine name: {"corrupted_requests", "runs": {label: {prompt: request}}}}).
"""

from __future__ import annotations

import copy
import json
import lzma
import threading
from pathlib import Path

from patchkit.verify import (
    adaptercontrols,
    enginefaults,
    engines,
    references,
    rule,
    serving,
    usermodel,
)
from patchkit.verify.adaptercontrols import HALF, IGNORED, NO_EXPERTS, Control

DATA = Path(__file__).parent / "data"
# served on the test H200 (2026-12-01): the 35B-A3B-wide cut with its healthy adapter a0,
# its controls and the PEFT reference; the tiny MoE of `verify --e2e`
WIDE = DATA / "h200-2026-12-01i-wide35b-served.json.xz"
TINY = DATA / "h200-2026-12-01i-e2e-moe-served.json.xz"


def load(path: Path) -> dict:
    with lzma.open(path, "rt") as handle:
        return json.load(handle)


WIDE_SERVED = load(WIDE)
CONTROLS = [Control("a0", HALF, Path("/c")), Control("a0", NO_EXPERTS, Path("/c")),
            Control("a0", IGNORED, None)]  # fmt: skip


def judge_wide(served: dict, controls: list | None = None, asked: str | None = None):
    """As run_model judges the wide cut: the merged reference first (where the run served
    one), then PEFT where it cannot decide; or the reference ``asked`` (--reference)."""
    served = copy.deepcopy(served)
    controls = {"a0": CONTROLS if controls is None else controls}
    peft = served.pop(engines.PEFT_ENTRY)
    chosen, need = usermodel.choose_references(served, ["a0"], controls, asked)
    served[engines.PEFT_ENTRY] = peft
    run = engines.Served.from_json(served, ["a0"], merged="merged-a0" in served)
    for name in need:
        chosen[name] = references.peft_or_merged(run, name, chosen[name])
    return usermodel.judge(served, ["a0"], controls, chosen)


def excesses(served: dict, prefix: str, peft: str, label: str, adapter: str) -> list:
    """rule.excess of ``label``'s answers against PEFT's answers of ``adapter``, per
    engine and prompt, the noise vLLM base against PEFT base on that prompt."""
    theirs = served[peft]["runs"]
    out = []
    for mode in serving.MODES:
        runs = served[f"{prefix}{mode}"]["runs"]
        for prompt, wanted in theirs[f"lora:{adapter}"].items():
            noise = rule.median_distance(
                runs["base"][prompt]["prompt_logprobs"], theirs["base"][prompt]["prompt_logprobs"]
            )
            values = runs[label][prompt]["prompt_logprobs"]
            out.append(rule.excess(values, wanted["prompt_logprobs"], noise))
    return out


def request(values) -> dict:
    return {"prompt_logprobs": list(values), "tokens": [5, 6, 7], "token_logprobs": [-1.0] * 3}


# How far each engine-side fault moves a fake adapter's answers, in units of its effect:
# doubled, one of few layers skipped, experts' down_proj dropped, another adapter's weights.
ENGINE_FAULT_EFFECT = {"scale-2": 2.0, "layer-skipped": 0.5, "experts-down-dropped": 0.5,
                       "b-permuted": -1.0}  # fmt: skip


def fake_served(adapters, prefix="", effect=0.3):
    """What vLLM would serve when everything is right: LoRA equals its merged reference;
    adapter number N moves every log-probability by N x ``effect``; its control at half
    strength moves it by half that, its engine-side controls as ENGINE_FAULT_EFFECT says."""
    prompts = {"p600": 600, "p3000": 3000}
    base = {p: [-8.0 + 0.01 * (i % 7) for i in range(n - 1)] for p, n in prompts.items()}

    def moved(p, by):
        return [v + by for v in base[p]]

    runs = {"base": {p: request(base[p]) for p in prompts}}
    for number, name in enumerate(adapters, start=1):
        runs[f"lora:{name}"] = {p: request(moved(p, -effect * number)) for p in prompts}
        half = {p: request(moved(p, -effect * number / 2)) for p in prompts}
        runs[f"control:{name}{adaptercontrols.SEP}{adaptercontrols.HALF}"] = half
        for fault, factor in ENGINE_FAULT_EFFECT.items():  # as the faults move LoRA
            kind = enginefaults.PREFIX + fault
            runs[f"control:{name}{adaptercontrols.SEP}{kind}"] = {
                p: request(moved(p, -effect * number * factor)) for p in prompts
            }
    runs["lora_after_long"] = {"p600": request(moved("p600", -effect))}
    runs["base_after_lora"] = copy.deepcopy(runs["base"])
    served = {}
    for mode in serving.MODES:
        served[f"{prefix}{mode}"] = {"corrupted_requests": 0, "runs": copy.deepcopy(runs)}
    for number, name in enumerate(adapters, start=1):
        merged = {p: request(moved(p, -effect * number)) for p in prompts}
        served[f"{prefix}merged-{name}"] = {"corrupted_requests": 0, "runs": {"merged": merged}}
        control = {p: request(moved(p, -effect * number + 0.004)) for p in prompts}
        served[f"{prefix}rounding-{name}"] = {"corrupted_requests": 0, "runs": {"merged": control}}
    return served


def fake_controls(adapters) -> dict[str, list]:
    """Each adapter's half-strength control (served) and its adapter-ignored one (base)."""
    return {
        name: [
            adaptercontrols.Control(name, adaptercontrols.HALF, Path(f"/c/{name}")),
            adaptercontrols.Control(name, adaptercontrols.IGNORED, None),
        ]
        for name in adapters
    }


def shift(group: dict, by: float) -> None:
    """Move every prompt log-probability of a group of requests by ``by``."""
    for one in group.values():
        one["prompt_logprobs"] = [v + by for v in one["prompt_logprobs"]]


def lora(served, mode="eager", name="one"):
    return served[mode]["runs"][f"lora:{name}"]


def merged(served, adapters, prefix="") -> dict:
    """Each adapter's merged reference, read from served as `verify --model` reads it."""
    from patchkit.verify import engines, references

    run = engines.Served.from_json(served, adapters, prefix)
    return {name: references.merged_reference(run, name, None) for name in adapters}


def when_ready(jobs: list, ready) -> None:
    """What serving.pool does before a job starts, for a test's stand-in of serve_all:
    wait until what the job reads is written (refwriter.ReferenceWriter.ready; it raises
    what the writing raised). A bounded wait on a thread, not a timing."""
    done = threading.Event()
    for _ in range(12000):  # 120 s at most: the tiny checkpoints are written in well under 1
        if ready is None or all(ready(job) for job in jobs):
            return
        done.wait(0.01)
    raise AssertionError("the merged references were never written")
