"""Does an adapter change anything? Its greedy answer against its parent's, same prompt.

An adapter whose targets vLLM does not wrap, whose tensor names miss the
model's prefix (vLLM #34186: "silently produce base-model output") or whose
lora_B is all zero is loaded, listed by `/v1/models` and served as its base
model, with no warning. The canary asks the base model and each adapter the
same prompt, greedy, with log-probabilities (an adapter named alone with
--model: its parent is asked once more); an adapter whose tokens are its
parent's and whose log-probabilities differ from the parent's by no more
than the server's own repeat noise changes nothing: `no-effect`, a finding.

REPEAT_NOISE is what a real server does with the same prompt asked again:
measured from the answers recorded on vLLM 0.26.0's OpenAI server
(scripts/proofs/canary_noeffect_gpu.py, tests/data/; the largest difference
between two answers of one model to one prompt), never a number chosen on a
stand-in. A healthy adapter, even a weak one, moves some greedy token's
log-probability by far more; tests/test_canary_noeffect.py checks both sides
on the recorded answers.
"""

from __future__ import annotations

import math
import shlex

from patchkit.codes import Code, Reason

# Measured on vLLM 0.26.0's OpenAI server (tests/data/canary-noeffect-0.26.0.json.xz,
# docs/evidence.md): asked one after another, as the canary asks, a model's repeats are
# bit-identical (0.0); batched with other requests its log-probabilities move by up to
# 0.0159 before any token parts, and a batched answer against an unbatched one by up to
# 0.0309. The bound is that largest, 0.031, with room (1.6x): a busy server's batching
# must not turn a no-op adapter's answer into an effect.
REPEAT_NOISE = 0.05
NO_EFFECT = "no-effect"


def judge_effects(models: list, parents: list = ()) -> None:
    """Compare each `ok` adapter with its `ok` parent (a checked model, or one asked only
    for this comparison: ``parents``): the comparison goes into ``effect``, and an answer
    equal within REPEAT_NOISE makes the adapter `no-effect`."""
    by_name = {v.model: v for v in [*parents, *models]}
    for verdict in models:
        parent = by_name.get(verdict.parent) if verdict.parent else None
        if parent is None or verdict.verdict != "ok" or parent.verdict != "ok":
            continue
        verdict.effect = compare(verdict, parent)
        if verdict.effect is not None and verdict.effect["same"]:
            verdict.effect["adapter_check"] = admission_command(verdict, parent)
            verdict.mark(
                NO_EFFECT,
                Code.CANARY_NO_EFFECT,
                parent=parent.model,
                tokens=len(verdict.token_ids),
                max_logprob_difference=verdict.effect["max_logprob_difference"],
                repeat_noise=REPEAT_NOISE,
            )


def compare(adapter, parent) -> dict | None:
    """How the adapter's answer stands against its parent's on the same prompt: the first
    token where they part (None: none), the largest log-probability difference before it,
    and whether that makes them the same answer. None when they cannot be compared (another
    prompt length, no token ids or log-probabilities, a value that is no finite number)."""
    if adapter.prompt_tokens != parent.prompt_tokens:
        return None
    mine, theirs = adapter.token_ids, parent.token_ids
    values, others = adapter.logprobs, parent.logprobs
    if not mine or not theirs or not values or not others:
        return None
    if len(values) != len(mine) or len(others) != len(theirs):
        return None
    if not all(isinstance(x, float) and math.isfinite(x) for x in [*values, *others]):
        return None
    parted = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
    if parted is None and len(mine) != len(theirs):
        parted = min(len(mine), len(theirs))
    shared = len(mine) if parted is None else parted
    delta = max(
        (abs(a - b) for a, b in zip(values[:shared], others[:shared], strict=True)), default=0.0
    )
    return {
        "parent": parent.model,
        "first_different_token": parted,
        "max_logprob_difference": delta,
        "repeat_noise": REPEAT_NOISE,
        "same": parted is None and delta <= REPEAT_NOISE,
    }


def next_steps(inert: list) -> list[Reason]:
    """What to do about adapters that change nothing: the likely causes, then the admission
    check to run on each one's files (the directory /v1/models gives as its root)."""
    if not inert:
        return []
    steps = [Reason.of(Code.CANARY_STEP_NO_EFFECT, adapters=[v.model for v in inert])]
    for v in inert:
        command = v.effect["adapter_check"]
        steps.append(Reason.of(Code.CANARY_STEP_ADAPTER_CHECK, adapter=v.model, command=command))
    return steps


def admission_command(adapter, parent) -> str:
    """`patchkit adapter check` on the adapter's files, as the server names them (quoted for
    a shell: the paths come from the server), with the base model's where known."""
    files = shlex.quote(adapter.root) if adapter.root else "ADAPTER_DIR"
    model = shlex.quote(parent.root) if parent.root else "BASE_MODEL_DIR"
    return f"patchkit adapter check {files} --model {model} --target SITE_PACKAGES"
