"""`patchkit verify --model DIR --lora NAME=DIR`: the user's own model and adapters under vLLM.

vLLM serves the model with every adapter (LoRA on, eager and CUDA-graph
mode), and, as the reference, each adapter merged into a copy of the base
weights (patchkit.verify.mergewrite: W + scale * B @ A, experts included) served
without LoRA. No transformers forward is needed, so a model that only fits
on its serving GPUs can be checked there. Prompts: 600, 3000 and the
largest that fits (at most 16k tokens, below --max-model-len), token ids
drawn from the model's plain vocabulary.

Bounds. LoRA served in bf16 computes x W + s (x A^T) B^T: base output and
LoRA output are each rounded to bf16 and added; the merged reference
rounds W + s B A to bf16 once, per weight. Where the delta is small
against W, that rounding moves a weight by up to half a bf16 step of W, a
perturbation of every changed weight; how much it moves the output grows
with the model's width and depth (measured on the test H200: mean
0.012-0.015 on an 8-layer stand-in, 0.032-0.034 on a Qwen3.5-27B-wide
cut; vLLM's own Triton kernels as far from the reference as patchkit's
torch path, docs/evidence.md). A fixed bound is therefore either too
tight for a large model or too loose for a small one, so each adapter gets
a rounding control: the same merge rounded stochastically (an equally
valid bf16 version of the same float32 weights), served like the
reference. How far the two references answer apart is the reference's own
precision, and LoRA may differ from the reference by ROUNDING_FACTOR times
that, never less than MERGED_BOUNDS.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from patchkit.errors import PatchkitError, UsageProblem
from patchkit.fs.files import read_user_json
from patchkit.verify import adaptercontrols, baserows, checks, serving
from patchkit.verify.checks import (
    FAILED,
    INCONCLUSIVE,
    PASSED,
    AdapterVerdict,
    Check,
    ControlResult,
)

PROMPT_LENGTHS = (600, 3000)
LONGEST = 16384
# (mean, max) |LoRA served - merged reference| of prompt log-probabilities that
# always passes, whatever the rounding control says: --e2e's bounds against
# transformers (the 8-layer stand-in measured 0.0116-0.0153 / 0.049-0.098 at
# TP=2, docs/evidence.md).
MERGED_BOUNDS = (0.03, 0.3)
# LoRA vs the reference may reach this many times the distance between the two
# roundings of the reference. Were the output linear in the weights, that distance
# would be about sqrt(3) times the reference's own error (nearest rounding's error
# spread is a step / sqrt(12), the difference's a step / 2), so this allows about
# 2.6 times the reference's error; measured on the H200, LoRA sat at 0.9-1.4
# times the distance (docs/evidence.md)...
ROUNDING_FACTOR = 1.5
# ...unless the roundings differ by more than this (mean): then the reference is
# too coarse to judge a LoRA path by, and the run says so instead of passing on it.
ROUNDING_LIMIT = 0.1
# The max bound never widens past this many nats: in a MoE model a near-tied
# routing choice that flips moves single tokens by up to 1.4 between the two
# roundings, but a bug that breaks a few positions (a chunk boundary, the first
# token) moves them further, and a control with one wild token must not let it by.
MAX_CEILING = 2.0
# Against the transformers + PEFT reference (float32) the floor is vLLM's own error on
# these very prompts, and on a wide MoE it reaches single tokens further than
# MAX_CEILING: on the H200's 35B-A3B-wide cut vLLM base against float32 base moved
# one token by up to 2.80-3.11 nats (a near-tied routing choice of 256 experts that
# bf16 flips), and LoRA against PEFT's LoRA by 1.85-2.69, inside it, while every
# control lay 1.7x the mean bound away (docs/evidence.md). There the max bound is
# ROUNDING_FACTOR x that floor, up to this many nats: a position moved further is
# broken whatever the engine's noise, and past it the max cannot decide.
PEFT_MAX_CEILING = 6.0
# ...and on a model with routed experts its max bound is never below MAX_CEILING: the
# engine's own worst token is one sample of a heavy tail, and a mild sample made a
# tight bound. On the H200 (tiny Qwen3.5-MoE, 8 experts top 2, `verify --e2e`) vLLM base
# vs PEFT base reached at most 0.98 nats on 3000 tokens, so the bound was 1.47, while
# the adapters on one expert parameter, healthy by every other row (mean 0.027-0.031,
# within 0.041-0.046, every control rejected 13x outside), reached 1.95 and 1.54 on
# three single tokens each, inside the 2.0 a merged MoE reference allows for the same
# near-tied routing choices (its two roundings moved one token by 1.45 there).
PEFT_MOE_MAX_FLOOR = MAX_CEILING
# LoRA must move the output by at least this share of what the merged adapter does...
EFFECT_SHARE = 0.5
# ...and the adapter must move it clearly more than bf16 noise, or the check cannot tell...
EFFECT_FLOOR = 0.01
# ...and clearly more than the bound allows LoRA to be off, or an adapter applied at
# a fraction of its strength would pass (on the H200 the bound was 9-12 % of the
# effect: MoE 0.06 of 0.60, 27B-wide `full` 0.052 of 0.45, `attn-mlp` 0.03 of 0.25).
RESOLUTION_LIMIT = 0.25
# Qwen tokenizers' plain BPE tokens lie below their special tokens (151643+ in
# Qwen2/3, 248044+ in Qwen3.5); prompts use ids below this.
PLAIN_VOCAB = 150000
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WAVE_TIMEOUT = 1800.0


def parse_lora(value: str) -> tuple[str, Path]:
    """NAME=DIR of one --lora, or one line (exit 2).

    adapter_config.json is looked at through the directory's descriptor, as every
    later read of it is (a link out of the adapter, a FIFO: refused, never followed).
    """
    from patchkit.adapters.directory import Directory

    name, sep, path = value.partition("=")
    # fullmatch: NAME's "$" also matches before a trailing newline ("one\n" passed)
    if not sep or not NAME.fullmatch(name) or not path:
        raise UsageProblem(
            f"--lora {value!r}: expected NAME=DIR (NAME of letters, digits, '.', '_', '-')"
        )
    directory = Path(path)
    try:
        with Directory(directory) as folder:
            if not folder.has("adapter_config.json"):
                raise UsageProblem(f"--lora {name}: {directory} holds no adapter_config.json")
            folder.open("adapter_config.json").close()
    except UsageProblem:
        raise
    except PatchkitError as exc:
        raise UsageProblem(f"--lora {name}: {exc}") from None
    return name, directory


def read_config(model_dir: Path) -> dict:
    """The model's text config (a multimodal model's text_config), or one line (exit 2)."""
    path = model_dir / "config.json"
    try:
        config = read_user_json(path)  # a FIFO named config.json hung read_text()
    except OSError as exc:
        raise UsageProblem(
            f"--model {model_dir}: no readable config.json there ({exc.strerror})"
        ) from None
    except ValueError as exc:
        raise UsageProblem(f"--model {model_dir}: config.json is unusable ({exc})") from None
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(text or {}, dict):
        raise UsageProblem(f"--model {model_dir}: config.json is not a model config (an object)")
    merged = {**config, **(text or {})}
    for key in ("vocab_size", "max_position_embeddings"):
        value = merged.get(key)
        # a string, a float or a negative number here raised ValueError/OverflowError
        if value is not None and (type(value) is not int or value < 1):
            raise UsageProblem(
                f"--model {model_dir}: config.json: {key} is {value!r}, not a positive integer"
            )
    return merged


def max_model_len(config: dict, asked: int | None) -> int:
    """--max-model-len, or 16k plus the generated tokens, within the model's positions.

    ``asked`` is the option as given: 0 is a length (refused), not "not given"."""
    positions = config.get("max_position_embeddings") or LONGEST + serving.GENERATED
    length = asked if asked is not None else min(LONGEST + serving.GENERATED, positions)
    check_max_model_len(length)
    return length


def check_max_model_len(length: int) -> None:
    """A length the checks can run in: room for the shortest prompt and its answer."""
    shortest = PROMPT_LENGTHS[0] + serving.GENERATED
    if length < shortest:
        raise UsageProblem(f"--max-model-len {length}: the checks need at least {shortest} tokens")


def prompt_lengths(length: int) -> list[int]:
    """600, 3000 and the largest prompt that fits (at most 16k), without repeats."""
    longest = min(LONGEST, length - serving.GENERATED)
    return sorted({n for n in PROMPT_LENGTHS if n <= longest} | {longest})


def make_prompts(config: dict, lengths: list[int], seed: int) -> dict[str, list[int]]:
    """Token-id prompts from the plain vocabulary, none of the config's special ids."""
    top = min(config.get("vocab_size") or PLAIN_VOCAB, PLAIN_VOCAB)
    special = {v for k, v in config.items() if k.endswith("token_id") and isinstance(v, int)}
    # Drawing and skipping special ids never ended when the vocabulary held no
    # plain id (vocab_size 2 with a pad id 1): refused first. The draw itself is
    # unchanged, so a seed gives the prompts it gave before.
    if all(token in special for token in range(1, top)):
        raise UsageProblem(
            f"config.json: vocab_size {top} leaves no plain token id to build prompts from"
        )
    rnd = random.Random(seed)
    out = {}
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            token = rnd.randrange(1, top)
            if token not in special:
                ids.append(token)
        out[f"p{n}"] = ids
    return out


def adapter_rank(adapter_dir: Path) -> int:
    """The largest rank an adapter uses (r and rank_pattern), read as the merge reads it
    (size-capped, every value checked: a raw json.loads had no cap and no checks)."""
    from patchkit.verify import adapterfiles

    config = adapterfiles.read_adapter_config(adapter_dir)
    return max(config.ranks)


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# ----- the merged references: plan, say, write, remove -----


def plan_references(model_dir: Path, adapters: dict[str, Path], workdir: Path, say) -> dict:
    """Plan every merge (headers only), say the disk they need, refuse when it is not free.

    Nothing is written before this returns, so a refusal leaves the disk as it was.
    """
    from patchkit.verify import mergeplan

    plans = {name: mergeplan.plan_merge(model_dir, path) for name, path in adapters.items()}
    needed = 2 * sum(plan.bytes_needed for plan in plans.values())  # reference and control
    free = shutil.disk_usage(_existing(workdir)).free
    say(
        f"merged references: {len(plans)} adapter(s), each merged twice (rounded to nearest, "
        f"and stochastically as the measure of the reference's own bf16 precision), need "
        f"{mergeplan.human_bytes(needed)} under {workdir} ({mergeplan.human_bytes(free)} free); "
        "removed afterwards unless --keep"
    )
    for plan in plans.values():
        for note in plan.notes:
            say(f"note: {note}")
    if needed > free:
        raise PatchkitError(
            f"the merged references need {mergeplan.human_bytes(needed)} under {workdir} and "
            f"{mergeplan.human_bytes(free)} is free; give --workdir a disk with more space"
        )
    return plans


def _existing(path: Path) -> Path:
    """The nearest existing directory at or above path (where disk_usage can look)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


# The two references of an adapter: merged and rounded to nearest, and its rounding
# control (the same merge rounded stochastically), each served by an engine of its own.
REFERENCES = ("merged", "rounding")


def write_references(plans: dict, workdir: Path, say, seed: int) -> dict[str, dict[str, Path]]:
    """Each merged checkpoint under workdir/merged-NAME, and its rounding control
    (the same merge rounded stochastically) under workdir/rounding-NAME."""
    from patchkit.verify import mergewrite

    out = {}
    for number, (name, plan) in enumerate(plans.items()):
        say(f"writing merged reference and rounding control for {name}")
        out[name] = {kind: workdir / f"{kind}-{name}" for kind in REFERENCES}
        mergewrite.write_merged(plan, out[name]["merged"])
        control_seed = (seed * 1000 + number) % (1 << 63)  # manual_seed takes < 2**64
        mergewrite.write_merged(plan, out[name]["rounding"], stochastic_seed=control_seed)
    return out


# ----- the engines -----


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of a run: the LoRA engine in one mode, or one adapter's reference."""

    name: str  # its job's name: its log, its files and its entry in served.json
    mode: str  # serving.MODES: eager, or torch.compile + CUDA graphs
    kind: str  # "lora" (every adapter, LoRA on), or one of REFERENCES (merged, no LoRA)
    adapter: str | None = None  # the adapter a reference is merged from; None for "lora"


def lora_engines(prefix: str = "") -> list[Engine]:
    """The LoRA engine in each mode, named PREFIX+MODE."""
    return [Engine(f"{prefix}{mode}", mode, "lora") for mode in serving.MODES]


def reference_engines(adapters: list[str], prefix: str = "") -> list[Engine]:
    """Each adapter's references, served eager without LoRA, named PREFIX+KIND-ADAPTER."""
    return [
        Engine(f"{prefix}{kind}-{adapter}", "eager", kind, adapter)
        for adapter in adapters
        for kind in REFERENCES
    ]


def engines(adapters: list[str], prefix: str = "") -> list[Engine]:
    """Every engine of a run, in the order they start. Names are made only here and in
    the two functions above; a prefix keeps two runs apart in one served.json (--e2e's
    MoE case is "moe-")."""
    return lora_engines(prefix) + reference_engines(adapters, prefix)


# served.json's entry of the transformers + PEFT reference (not a vLLM engine)
PEFT_ENTRY = "peft"


@dataclass
class EngineServed:
    """What one engine served: its result as patchkit.verify.serving wrote it,
    ``{"corrupted_requests", "runs", ...}`` or ``{"error": ...}`` (checks reads it)."""

    engine: Engine
    result: dict

    @property
    def runs(self) -> dict:
        """{request label: {prompt: request}}; {} when the engine did not run."""
        return self.result.get("runs", {})


@dataclass
class Served:
    """Every engine of a run and what it served, found by what the engine is."""

    engines: list[EngineServed]
    peft: dict | None = None  # the PEFT reference's result, when it ran

    @classmethod
    def from_json(
        cls, served: dict, adapters: list[str], prefix: str = "", merged: bool = True
    ) -> Served:
        """served.json's form, ``{engine name: result}`` (what serving.serve_all returns
        and recorded runs hold), read for the engines of a run of these adapters
        (without merged references when ``merged`` is False: `--reference peft`)."""
        wanted = engines(adapters, prefix) if merged else lora_engines(prefix)
        return cls([EngineServed(e, served[e.name]) for e in wanted], served.get(PEFT_ENTRY))

    def lora(self) -> list[EngineServed]:
        """The LoRA engines, one per mode, in serving.MODES order."""
        return [s for s in self.engines if s.engine.kind == "lora"]

    def reference(self, kind: str, adapter: str) -> EngineServed:
        """The engine serving ``adapter``'s reference of ``kind`` (one of REFERENCES)."""
        return next(
            s for s in self.engines if s.engine.kind == kind and s.engine.adapter == adapter
        )


def lora_requests(
    adapters: list[str], prompts: dict, control_names: list[str] = ()
) -> list[tuple[str, str, str | None]]:
    """Base, every adapter, every control, a short prompt after the longest, base again."""
    names = list(prompts)
    plan = [("base", p, None) for p in names]
    for adapter in adapters:
        plan += [(f"lora:{adapter}", p, adapter) for p in names]
    for control in control_names:
        plan += [(f"control:{control}", p, control) for p in names]
    plan.append(("lora_after_long", names[0], adapters[0]))
    plan += [("base_after_lora", p, None) for p in names]
    return plan


def served_controls(controls: dict[str, list] | None) -> dict[str, str]:
    """{LoRA name: directory} of the controls that are served (not judged on base)."""
    return {
        c.name: str(c.path)
        for group in (controls or {}).values()
        for c in group
        if c.path is not None
    }


def jobs(
    model_dir: Path,
    adapters: dict[str, Path],
    references: dict[str, dict[str, Path]],
    setup: dict,
    prefix: str = "",
    controls: dict[str, list] | None = None,
) -> list[serving.Job]:
    """The LoRA engine in each mode (every adapter and control), and one eager engine
    per merged reference and rounding control (none with `--reference peft`)."""
    prompts = setup["prompts"]
    common = {
        k: setup[k]
        for k in (
            "tensor_parallel_size",
            "max_model_len",
            "seed",
            "gpu_memory_utilization",
            "kv_cache_bytes",
        )
    }
    rank = serving.lora_rank_limit(max(adapter_rank(p) for p in adapters.values()))
    extra = served_controls(controls)
    out = [
        serving.Job(
            name=engine.name,
            model=str(model_dir),
            mode=engine.mode,
            prompts=prompts,
            requests=lora_requests(list(adapters), prompts, list(extra)),
            loras={**{n: str(p) for n, p in adapters.items()}, **extra},
            max_lora_rank=rank,
            **common,
        )
        for engine in lora_engines(prefix)
    ]
    requests = [("merged", p, None) for p in prompts]
    for engine in reference_engines(list(references), prefix):
        out.append(
            serving.Job(
                name=engine.name,
                model=str(references[engine.adapter][engine.kind]),
                mode=engine.mode,
                prompts=prompts,
                requests=requests,
                **common,
            )
        )
    return out + baserows.jobs(str(model_dir), prompts, common, prefix)  # LoRA off, per mode


# ----- the references an adapter is judged against -----


@dataclass
class Reference:
    """What one adapter's LoRA answers are judged against, and how precise it is.

    ``floors`` is, per LoRA engine (mode) and prompt, the (mean, max) distance
    that says how far the reference itself is from what vLLM would answer if
    nothing were wrong: for the merged reference its two bf16 roundings
    (nearest vs stochastic), the same for every mode; for the PEFT reference
    |vLLM base - PEFT base| of that mode's engine (vLLM's own bf16 error
    against float32). ``base`` is the reference's answers without the
    adapter (None: vLLM's own base answers), for the adapter's effect.

    Both take the same bound, ROUNDING_FACTOR (1.5) x the floor (bounds_for).
    For PEFT that factor rests on the tiny Qwen3.5-MoE measured on the H200
    with a real PEFT 0.21 target_parameters adapter: vLLM LoRA vs PEFT LoRA
    0.077 mean against vLLM base vs PEFT base 0.088 (LoRA adds 0.88 x the
    engine's own error, not more), effect 0.383. 1.5 x 0.088 = 0.132 leaves
    1.7 x headroom over what LoRA measured and is 34 % of the effect: the
    adapter at half strength sits about 0.19 from the reference, outside it.
    The controls check that on every run instead of trusting it.
    """

    kind: str  # "merged" or "peft"
    runs: dict | None  # {prompt: request}; None when it did not run
    floors: dict[str, dict[str, tuple[float, float]]]
    why: str  # why this reference judges the adapter
    missing: str = ""  # why it did not run, when runs is None
    base: dict | None = None
    max_floor: float = MERGED_BOUNDS[1]  # the least max bound (PEFT_MOE_MAX_FLOOR on MoE)


def merged_reference(run: Served, adapter: str, why: str) -> Reference:
    """The merged reference: floors from its rounding control, the same in every mode."""
    runs = _reference_runs(run, "merged", adapter)
    floors = rounding_floors(run, adapter)
    error = run.reference("merged", adapter).result.get("error", "")
    return Reference("merged", runs, {lora.engine.name: floors for lora in run.lora()},
                     why, missing=error or "it served nothing")  # fmt: skip


def peft_reference(run: Served, adapter: str, why: str) -> Reference:
    """The transformers + PEFT reference: floors from vLLM base vs PEFT base, per mode."""
    peft = run.peft or {"error": "not run"}
    runs = peft.get("runs", {})
    mine, base = runs.get(f"lora:{adapter}"), runs.get("base")
    if "error" in peft or not isinstance(mine, dict) or "error" in mine or not base:
        missing = peft.get("error") or (mine or {}).get("error") or "it served nothing"
        return Reference("peft", None, {}, why, missing=f"the PEFT reference: {missing}")
    floors = {}
    for lora in run.lora():
        vllm_base = lora.runs.get("base") or {}
        floors[lora.engine.name] = _floors(vllm_base, base)
    routed = any(lora.result.get("routed_experts", 0) for lora in run.lora())
    max_floor = PEFT_MOE_MAX_FLOOR if routed else MERGED_BOUNDS[1]
    return Reference("peft", mine, floors, why, base=base, max_floor=max_floor)


def _floors(ours: dict, theirs: dict) -> dict[str, tuple[float, float]]:
    """Per prompt of ``theirs``, (mean, max) |ours - theirs|; {} when one is missing or
    a value is not finite (no precision can be read from it)."""
    floors = {}
    for prompt, request in theirs.items():
        other = ours.get(prompt)
        if not isinstance(request, dict) or not isinstance(other, dict):
            return {}
        floor = checks.diff(other["prompt_logprobs"], request["prompt_logprobs"])
        if not all(math.isfinite(v) for v in floor):
            return {}
        floors[prompt] = floor
    return floors


def _reference_runs(run: Served, kind: str, adapter: str) -> dict | None:
    return run.reference(kind, adapter).runs.get("merged")


def rounding_floors(run: Served, adapter: str) -> dict[str, tuple[float, float]]:
    """Per prompt, (mean, max) |reference - rounding control|: the reference's own
    precision. {} when either did not run or a value is not finite."""
    merged = _reference_runs(run, "merged", adapter)
    control = _reference_runs(run, "rounding", adapter)
    if not merged or not control:
        return {}
    return _floors(control, merged)


# ----- the checks -----


def compare(
    served: dict,
    adapters: list[str],
    prefix: str = "",
    controls: dict[str, list] | None = None,
    references: dict[str, Reference] | None = None,
) -> list[Check]:
    """Every check of one `--model` run: the references, then each mode.

    ``served`` is served.json's form (serving.serve_all's, or a recorded run's),
    read here once into what each engine served. Each adapter is judged
    against ``references[adapter]`` (default: its merged reference) and
    its ``controls`` (patchkit.verify.adaptercontrols) must be rejected.
    """
    run = Served.from_json(served, adapters, prefix, merged=_any_merged(references))
    references = references or {a: merged_reference(run, a, "") for a in adapters}
    out = []
    for name in adapters:
        if references[name].kind == "merged":
            out += merged_reference_checks(f"{prefix}reference {name}", run, name)
    for lora in run.lora():
        out += compare_mode(lora, run, adapters, references, controls or {})
    lora_names = {e.engine.mode: e.engine.name for e in run.lora()}
    return out + baserows.base_rows_checks(served, lora_names, prefix)


def _any_merged(references: dict[str, Reference] | None) -> bool:
    return references is None or any(r.kind == "merged" for r in references.values())


def merged_reference_checks(label: str, run: Served, name: str) -> list[Check]:
    """The merged reference and its rounding control ran, healthy, and are precise
    enough to judge by; a problem here leaves the adapter undecided, not failed
    (the reference is the adapter merged into bf16 weights, not vLLM's LoRA path)."""
    result = run.reference("merged", name).result
    out = checks.engine_ran(f"{label} (merged, no LoRA)", result)
    if "error" not in result:
        out += checks.health_checks(f"{label} (merged, no LoRA)", result)
    out += rounding_check(label, run, name, rounding_floors(run, name))
    return [_undecided(c, name) for c in out]


def _undecided(check: Check, adapter: str) -> Check:
    return Check(check.name, check.ok, check.detail, adapter, decided=check.ok)


def compare_mode(
    lora: EngineServed, run: Served, adapters: list[str], references: dict, controls: dict
) -> list[Check]:
    """One LoRA engine: health, each adapter against its reference, the repeats."""
    name, result = lora.engine.name, lora.result
    ran = checks.engine_ran(name, result)
    if "error" in result:
        return ran
    runs = result["runs"]
    out = ran + checks.health_checks(name, result)
    for adapter in adapters:
        reference = references[adapter]
        floors = reference.floors.get(name, {})
        out += adapter_checks(name, adapter, runs, reference, floors, controls.get(adapter, []))
    out.append(
        checks.repeat_check(
            name, runs, "base_after_lora", "base", "base after LoRA equals base before"
        )
    )
    out.append(
        checks.repeat_check(
            name,
            runs,
            "lora_after_long",
            f"lora:{adapters[0]}",
            "short prompt after a long one unaffected",
        )
    )
    return out


def rounding_check(
    label: str, run: Served, adapter: str, floors: dict[str, tuple[float, float]]
) -> list[Check]:
    """The rounding control ran, and the reference is precise enough to judge LoRA by
    (``floors``: rounding_floors of this adapter)."""
    control = run.reference("rounding", adapter).result
    ran = checks.engine_ran(f"{label} (rounding control)", control)
    if "error" in control or "error" in run.reference("merged", adapter).result:
        return ran
    title = f"{label}: its own bf16 rounding"
    if not floors:
        why = (
            "no finite distance between the two references: NaN or inf in their answers "
            "(the merged weights hold them), or a prompt missing from one of them"
        )
        return [*ran, Check(title, False, why)]
    means = [f[0] for f in floors.values()]
    detail = (
        f"mean |nearest - stochastic| {min(means):.4f}-{max(means):.4f} (<= {ROUNDING_LIMIT}), "
        f"max {max(f[1] for f in floors.values()):.3f}; LoRA allowed {ROUNDING_FACTOR}x that"
    )
    if max(means) > ROUNDING_LIMIT:
        detail += ": the reference is too coarse in bf16 to judge a LoRA path by"
    return [*ran, Check(title, max(means) <= ROUNDING_LIMIT, detail)]


def extent(floors: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """The largest (mean, max) distance over the prompts of non-empty ``floors``: the
    reference's precision as one perturbation, taken whole (bounds_for says why)."""
    return max(f[0] for f in floors.values()), max(f[1] for f in floors.values())


def ceiling_for(kind: str) -> float:
    """The max bound's ceiling for a reference kind: MAX_CEILING for the merged one,
    PEFT_MAX_CEILING for transformers + PEFT (the engine's own error is its floor)."""
    return PEFT_MAX_CEILING if kind == "peft" else MAX_CEILING


def bounds_for(
    floors: dict[str, tuple[float, float]] | None,
    ceiling: float = MAX_CEILING,
    max_floor: float = MERGED_BOUNDS[1],
) -> tuple[float, float]:
    """MERGED_BOUNDS (the max at least ``max_floor``), widened to ROUNDING_FACTOR x the
    reference's own rounding.

    The rounding is one perturbation of the adapter's weights, so its size is
    taken over all prompts (the largest mean and max), not prompt by prompt:
    one prompt's distance is a sample of it, and in a MoE model a sample that
    a few routing flips decide (on the H200 the MoE reference's two roundings
    differed by 0.031 on 600 tokens and 0.040 on 3000).
    """
    if not floors:
        return MERGED_BOUNDS[0], max_floor
    mean, worst = extent(floors)
    return (
        max(MERGED_BOUNDS[0], round(ROUNDING_FACTOR * mean, 4)),
        min(ceiling, max(max_floor, round(ROUNDING_FACTOR * worst, 3))),
    )


def decisive(floors: dict[str, tuple[float, float]] | None, ceiling: float = MAX_CEILING) -> bool:
    """Whether LoRA outside the bound is vLLM's fault: the reference's own distance from
    vLLM is small (mean <= ROUNDING_LIMIT) and the max bound was not cut below
    ROUNDING_FACTOR x it by MAX_CEILING. Otherwise a LoRA answer outside the bound
    may be the reference's own noise: INCONCLUSIVE, not FAILED."""
    if not floors:
        return False
    mean, worst = extent(floors)
    return mean <= ROUNDING_LIMIT and ROUNDING_FACTOR * worst <= ceiling


def adapter_checks(
    name: str,
    adapter: str,
    runs: dict,
    reference: Reference | dict | None,
    floors: dict | None = None,
    controls: list | None = None,
) -> list[Check]:
    """The adapter loaded, answers finite, matches its reference within the reference's
    own precision (``floors``, per prompt, taken together by bounds_for), changes the
    output, and each control falls outside the bound. ``reference`` may be the merged
    reference's answers alone ({prompt: request}), as recorded runs hold them."""
    if not isinstance(reference, Reference):
        reference = Reference("merged", reference, {name: floors or {}}, "")
    label = f"lora:{adapter}"
    error = checks.served_error(runs, label)
    if error:
        return [Check(f"{name}: {adapter} adapter served", False, error, adapter)]
    health = checks.rows_check(f"{name}: {adapter} answers", runs, [label])
    if not health.ok:
        return [Check(health.name, False, health.detail, adapter)]
    against = f"vs {reference.kind}"
    if not reference.runs:
        why = f"the reference did not run: {reference.missing}"
        return [Check(f"{name}: {adapter} {against}", False, why, adapter, decided=False)]
    ceiling = ceiling_for(reference.kind)
    bounds = bounds_for(floors, ceiling, reference.max_floor)
    sure = decisive(floors, ceiling)
    out = []
    for prompt in runs[label]:
        title = f"{name}: {adapter} {prompt[1:]} tokens {against}"
        found = checks.bound_check(
            title,
            checks.logprobs(runs, label, prompt),
            reference.runs[prompt]["prompt_logprobs"],
            bounds,
        )
        if not found.ok and not sure:
            found.detail += f": within this reference's own noise ({_floor_text(floors)})"
        out.append(Check(found.name, found.ok, found.detail, adapter, decided=found.ok or sure))
    out.append(effect_check(name, adapter, runs, reference.runs, bounds[0], reference.base))
    for control in controls or []:
        out.append(control_check(name, control, runs, reference.runs, bounds))
    return out


def _floor_text(floors: dict | None) -> str:
    if not floors:
        return "unknown: no finite distance measured"
    mean, worst = extent(floors)
    return f"mean {mean:.4f}, max {worst:.3f}"


def control_check(name: str, control, runs: dict, reference: dict, bounds) -> Check:
    """A control (patchkit.verify.adaptercontrols) served like the adapter: the bound must
    reject it on some prompt, or the run could not tell it from the adapter."""
    title = f"{name}: {control.adapter} control {control.what} rejected"
    error = checks.served_error(runs, control.label)
    if error:
        return Check(title, False, f"not served: {error}", control.adapter, decided=False)
    worst = None
    for prompt in runs[control.label]:
        if prompt not in reference:
            continue
        found = checks.bound_check(
            title,
            checks.logprobs(runs, control.label, prompt),
            reference[prompt]["prompt_logprobs"],
            bounds,
        )
        if not found.ok:
            detail = f"{prompt[1:]} tokens: {found.detail}"
            return Check(title, True, detail, control.adapter)
        worst = found.detail
    why = f"inside the bound on every prompt ({worst}): this reference cannot tell it apart"
    return Check(title, False, why, control.adapter, decided=False)


def effect_check(
    name: str,
    adapter: str,
    runs: dict,
    merged: dict,
    bound: float = MERGED_BOUNDS[0],
    reference_base: dict | None = None,
) -> Check:
    """LoRA moves the output by at least half of what the reference's adapter moves it.

    Served with the adapter silently not applied, LoRA equals base; the
    reference says how far it should be (from its own base answers when it
    has them: PEFT's, else vLLM's). An adapter whose effect is below
    EFFECT_FLOOR cannot be told from noise: undecided, with the reason. The
    bound's share of the effect is reported; the controls decide whether the
    run could tell a weaker adapter apart.
    """
    label = f"lora:{adapter}"
    served, wanted = [], []
    for prompt in runs[label]:
        base = checks.logprobs(runs, "base", prompt)
        theirs = (
            checks.logprobs({"base": reference_base}, "base", prompt) if reference_base else base
        )
        served.append(checks.diff(checks.logprobs(runs, label, prompt), base)[0])
        wanted.append(checks.diff(merged[prompt]["prompt_logprobs"], theirs)[0])
    share = min(s / w if w else 0.0 for s, w in zip(served, wanted, strict=True))
    title = f"{name}: {adapter} adapter differs from base"
    if min(wanted) < EFFECT_FLOOR:
        return Check(
            title,
            False,
            f"the reference's adapter moves log-probs by {min(wanted):.4f} "
            f"only (< {EFFECT_FLOOR}): too little to tell LoRA applied from not",
            adapter,
            decided=False,
        )
    resolution = bound / min(wanted)
    detail = (
        f"mean |LoRA - base| {min(served):.4f}, reference {min(wanted):.4f}; "
        f"smallest share {share:.2f} (>= {EFFECT_SHARE}); the bound is "
        f"{resolution:.0%} of the effect"
    )
    if resolution > RESOLUTION_LIMIT:
        detail += (
            f" (> {RESOLUTION_LIMIT:.0%}: an adapter at {1 - resolution:.0%} of its strength "
            "could pass; the controls say what this run tells apart)"
        )
    return Check(title, share >= EFFECT_SHARE, detail, adapter)


# ----- the verdicts -----


@dataclass
class ModelResult:
    """`verify --model`'s result: every check, and a verdict per adapter."""

    checks: list[Check]
    adapters: list[AdapterVerdict]

    @property
    def verdict(self) -> str:
        """FAILED if a check of an engine or the run failed, or an adapter did; else
        INCONCLUSIVE if an adapter is; else PASSED."""
        engine_failed = any(c.failed for c in self.checks if c.adapter is None)
        found = [a.verdict for a in self.adapters]
        return checks.overall([*found, FAILED] if engine_failed else found)


PEFT_DECIDES = (
    "`--reference peft` (transformers + PEFT in float32 from the same bf16 weights, the "
    "adapter unmerged)"
)


def adapter_verdict(
    adapter: str, found: list[Check], reference: Reference, controls
) -> AdapterVerdict:
    """One adapter's verdict from its checks (those of every LoRA engine and of its
    reference): FAILED on a decided failure, INCONCLUSIVE on a check its reference
    could not decide (a control inside the bound among them), else PASSED."""
    mine = [c for c in found if c.adapter == adapter]
    results = control_results(mine, controls)
    failed = [c for c in mine if c.failed]
    crashed = [c for c in found if c.adapter is None and c.failed and c.name.endswith("vLLM ran")]
    verdict = AdapterVerdict(adapter, PASSED, reference.kind, reference.why, "", "", results)
    if failed or crashed:
        first = (crashed or failed)[0]
        verdict.verdict, verdict.why = FAILED, f"{first.name}: {first.detail}"
        return verdict
    open_ = [c for c in mine if not c.ok]
    if open_:
        verdict.verdict, verdict.why = INCONCLUSIVE, f"{open_[0].name}: {open_[0].detail}"
        verdict.decides_instead = (
            PEFT_DECIDES
            if reference.kind == "merged"
            else "nothing this run has: vLLM's own bf16 error against float32 is as large "
            "as what tells the adapter from its controls; a longer prompt set or a stronger "
            "adapter would"
        )
        return verdict
    verdict.why = f"within the {reference.kind} reference's bound"
    if results:
        verdict.why += ", and every control outside it"
    return verdict


def control_results(mine: list[Check], controls) -> list[ControlResult]:
    """Each control: rejected when every engine rejected it, None when one did not serve it."""
    out = []
    for control in controls:
        rows = [c for c in mine if c.name.endswith(f" control {control.what} rejected")]
        if not rows:
            continue
        if any(c.detail.startswith("not served") for c in rows):
            out.append(ControlResult(control.what, None, rows[0].detail))
            continue
        misses = [c for c in rows if not c.ok]
        out.append(ControlResult(control.what, not misses, (misses or rows)[0].detail))
    return out


def judge(
    served: dict,
    adapters: list[str],
    controls: dict[str, list],
    references: dict[str, Reference],
    prefix: str = "",
    admission: list[Check] | None = None,
) -> ModelResult:
    """Checks and a verdict per adapter, each adapter against ``references[adapter]``;
    ``admission`` (admission_checks: what `adapter check` found) comes first."""
    found = (admission or []) + compare(served, adapters, prefix, controls, references)
    verdicts = [adapter_verdict(a, found, references[a], controls.get(a, [])) for a in adapters]
    return ModelResult(found, verdicts)


def choose_references(
    served: dict, adapters: list[str], controls: dict, asked: str | None, prefix: str = ""
) -> tuple[dict[str, Reference], list[str]]:
    """The reference of each adapter, and the adapters that need the PEFT reference.

    ``asked`` is --reference (merged, peft) or None: then the merged reference
    judges an adapter where it decides (its rounding control small, as on the
    dense shapes, and every control rejected), and the PEFT reference where it
    does not, said with why.
    """
    if asked == "peft":
        why = "--reference peft"
        return {a: Reference("peft", None, {}, why) for a in adapters}, list(adapters)
    run = Served.from_json(served, adapters, prefix)
    forced = "--reference merged"
    merged = {a: merged_reference(run, a, forced if asked else "") for a in adapters}
    if asked == "merged":
        return merged, []
    first = judge(served, adapters, controls, merged, prefix)
    need = []
    for verdict in first.adapters:
        reference = merged[verdict.adapter]
        if verdict.verdict == INCONCLUSIVE:
            reference.why = f"the merged reference could not decide ({verdict.why})"
            need.append(verdict.adapter)
        else:
            floors = rounding_floors(run, verdict.adapter)
            reference.why = f"its own bf16 rounding is small ({_floor_text(floors)})"
    return merged, need


# ----- the whole run -----

REFERENCE_CHOICES = ("merged", "peft")


def prepare(
    model_dir: Path,
    loras: list[tuple[str, Path]],
    tp: int,
    asked_len: int | None,
    seed: int,
    reference: str | None = None,
) -> dict:
    """What is decided before any GPU work: config, prompt lengths, prompts (exit 2 if bad)."""
    names = [n for n, _ in loras]
    if len(set(names)) != len(names):
        raise UsageProblem(f"--lora: a NAME given twice ({', '.join(names)})")
    if reference is not None and reference not in REFERENCE_CHOICES:
        raise UsageProblem(f"--reference {reference!r}: one of {', '.join(REFERENCE_CHOICES)}")
    config = read_config(model_dir)
    length = max_model_len(config, asked_len)
    return {
        "config": config,
        "adapters": dict(loras),
        "tensor_parallel_size": tp,
        "max_model_len": length,
        "prompts": make_prompts(config, prompt_lengths(length), seed),
        "seed": seed,
        "reference": reference,
    }


def with_memory(setup: dict, model_dir: Path, gpu: tuple[int, int]) -> tuple[dict, int]:
    """Add each engine's memory to setup; return how many engines run side by side."""
    total, free = gpu
    kv = 2 * serving.GIB
    vocab = setup["config"].get("vocab_size") or PLAIN_VOCAB
    fraction = serving.engine_memory(
        weight_bytes(model_dir), vocab, setup["tensor_parallel_size"], kv, total
    )
    setup = {**setup, "gpu_memory_utilization": fraction, "kv_cache_bytes": kv}
    return setup, serving.side_by_side(fraction, 0.9 * free / total)


def run_model(
    model_dir: Path,
    setup: dict,
    workdir: Path | None,
    keep: Path | None,
    gpu: tuple[int, int],
    say: Callable[[str], None],
) -> ModelResult:
    """Build the controls, write the merged references (unless `--reference peft`),
    serve everything, add the PEFT reference where it decides, judge; clean up unless keep."""
    adapters = setup["adapters"]
    asked = setup.get("reference")
    plans = {}
    if asked != "peft":
        plans = setup.get("plans") or plan_references(
            model_dir, adapters, reference_base(keep, workdir), say
        )
    work, made = _workdir(keep, workdir)
    try:
        controls = {
            name: adaptercontrols.build(name, path, work) for name, path in adapters.items()
        }
        say(f"controls: {describe_controls(controls)}")
        references = write_references(plans, work, say, setup["seed"]) if plans else {}
        setup, at_once = with_memory(setup, model_dir, gpu)
        engines = jobs(model_dir, adapters, references, setup, controls=controls)
        say(
            f"serving {model_dir}: {len(engines)} engines, {at_once} at a time, "
            f"prompts {', '.join(p[1:] for p in setup['prompts'])} tokens"
        )
        served = serving.serve_all(engines, work, WAVE_TIMEOUT, at_once)
        chosen, need = choose_references(served, list(adapters), controls, asked)
        if need:
            say(f"PEFT reference (transformers + PEFT, float32) for {', '.join(need)}")
            served[PEFT_ENTRY] = run_peft_reference(
                model_dir, {n: adapters[n] for n in need}, setup["prompts"], work
            )
            run = Served.from_json(served, list(adapters), merged=bool(references))
            for name in need:
                chosen[name] = peft_or_merged(run, name, chosen[name])
        (work / "served.json").write_text(json.dumps(served))
        return judge(served, list(adapters), controls, chosen, admission=setup.get("admission"))
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)  # this run's own directory
            if made:  # --workdir was created by this run: removed if nothing else is there
                with contextlib.suppress(OSError):
                    workdir.rmdir()


def peft_or_merged(run: Served, name: str, merged: Reference) -> Reference:
    """The PEFT reference for an adapter the merged one could not decide; when PEFT did
    not run (no transformers, no peftref), the merged verdict stands and says why."""
    why = merged.why if merged.kind == "peft" else f"{merged.why}; the PEFT reference decides"
    peft = peft_reference(run, name, why)
    if peft.runs is None and merged.kind == "merged":
        merged.why += f"; it did not run, {peft.missing}"
        return merged
    return peft


def admission_checks(adapters: dict[str, Path], model_dir: Path, tree) -> list[Check]:
    """`patchkit adapter check` of each adapter against the model and the vLLM tree that
    will serve it, as rows: a finding fails the adapter (NaN in a factor, a shape the
    model does not have, what this release refuses), and the run still serves it, so a
    poisoned adapter is also seen failing in serving."""
    from patchkit.adapters.check import check

    out = []
    for name, path in adapters.items():
        report = check(path, model_dir, target=tree)
        if report.ok:
            detail = f"{report.tensors} tensors, no finding"
            out.append(Check(f"adapter check {name}", True, detail, adapter=name))
        for finding in report.findings:
            where = " ".join(part for part in (finding.file, finding.tensor) if part)
            title = f"adapter check {name}: {finding.kind}"
            out.append(Check(title, False, f"{where}: {finding.message}", adapter=name))
    return out


def describe_controls(controls: dict[str, list]) -> str:
    """'a0: 50 % strength, experts ignored, adapter ignored; b: ...' for the log."""
    return "; ".join(
        f"{name}: {', '.join(c.what for c in group)}" for name, group in controls.items()
    )


def run_peft_reference(
    model_dir: Path, adapters: dict[str, Path], prompts: dict, work: Path
) -> dict:
    """transformers + PEFT's answers (patchkit.verify.peftref in a child process), in a
    served engine's form, or ``{"error": ...}`` (the verdict then says why)."""
    try:
        from patchkit.verify import peftref
    except ImportError as exc:
        return {"error": f"patchkit.verify.peftref cannot be imported ({exc})"}
    job = peftref.job(model_dir, adapters, prompts, name=PEFT_ENTRY)  # every GPU: alone
    return serving.wait(serving.start([job], work), work, WAVE_TIMEOUT)[PEFT_ENTRY]


def reference_base(keep: Path | None, workdir: Path | None) -> Path:
    """The directory whose disk the merged references go on."""
    return keep if keep is not None else Path(workdir or tempfile.gettempdir())


def _workdir(keep: Path | None, workdir: Path | None) -> tuple[Path, bool]:
    """Where this run writes: --keep itself, or a new directory of its own under --workdir
    (or the system's temporary directory), which it alone removes afterwards; and whether
    this run created --workdir (then it goes too, if nothing else is left in it)."""
    if keep is not None:
        _claim(keep)
        return keep, False
    made = workdir is not None and _claim(workdir)
    return Path(tempfile.mkdtemp(prefix="patchkit-verify-", dir=workdir)), made


def _claim(path: Path) -> bool:
    """Check again, right before the first write, that ``path`` is a new or an empty real
    directory (the option's check ran minutes earlier, before the GPU checks): created
    here, or there, empty and no link. True when created here. Something put there
    since, a link above all, is refused rather than written through."""
    try:
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        pass
    except OSError as exc:
        raise PatchkitError(f"{path}: cannot create it ({exc.strerror})") from None
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        empty = is_dir and not any(path.iterdir())
    except OSError as exc:
        raise PatchkitError(f"{path}: cannot read it ({exc.strerror})") from None
    if not empty:
        what = "a link or not a directory" if not is_dir else "not empty"
        raise PatchkitError(
            f"{path}: {what} by the time verify was to write there (it was new or empty "
            "when verify started); nothing was written; give a new directory"
        )
    return False
