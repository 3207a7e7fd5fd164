"""Does an adapter change anything? Its greedy answer against its parent's, same prompt.

An adapter whose targets vLLM does not wrap, whose tensor names miss the
model's prefix (vLLM #34186) or whose lora_B is all zero is loaded, listed by
`/v1/models` and served as its base model, with no warning. The canary already
asks the base model and each adapter the same prompt, greedy, with
log-probabilities; an adapter whose tokens are the parent's and whose
log-probabilities differ by no more than the server's own repeat noise
changes nothing: `no-effect`.
"""

from __future__ import annotations

import math

# PROVISIONAL (until the recorded answers of a real server are in tests/data):
# the largest |difference| of a greedy token's log-probability between two
# answers to the same prompt that still counts as the same answer.
REPEAT_NOISE = 1e-3
NO_EFFECT = "no-effect"


def judge_effects(models: list, parents: list = ()) -> None:
    """Mark each `ok` adapter whose answer equals its `ok` parent's as `no-effect`; a parent
    is a checked model or one asked only for this comparison (``parents``)."""
    by_name = {v.model: v for v in [*parents, *models]}
    for verdict in models:
        parent = by_name.get(verdict.parent) if verdict.parent else None
        if parent is None or verdict.verdict != "ok" or parent.verdict != "ok":
            continue
        delta = difference(verdict, parent)
        if delta is not None and delta <= REPEAT_NOISE:
            verdict.mark(
                NO_EFFECT,
                f"the same {len(verdict.token_ids)} greedy tokens as its base model "
                f"'{parent.model}', log-probabilities within {delta:.2g} (the server's "
                f"repeat noise: {REPEAT_NOISE:g}): the adapter changes nothing",
            )


def difference(adapter, parent) -> float | None:
    """The largest |logprob difference| when both answered the same prompt with the same
    tokens; None when they cannot be compared or the tokens differ."""
    if adapter.prompt_tokens != parent.prompt_tokens:
        return None
    if not adapter.token_ids or adapter.token_ids != parent.token_ids:
        return None
    mine, theirs = adapter.logprobs, parent.logprobs
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    pairs = list(zip(mine, theirs, strict=True))
    if not all(isinstance(x, float) and math.isfinite(x) for pair in pairs for x in pair):
        return None
    return max(abs(a - b) for a, b in pairs)


def summary(inert: list) -> str:
    """The part of the canary's one-line verdict about adapters that change nothing."""
    from patchkit.canary import fields

    names = ", ".join(f"'{fields.one_line(v.model, 60)}'" for v in inert[:3])
    more = f" and {len(inert) - 3} more" if len(inert) > 3 else ""
    verb = "answers" if len(inert) == 1 else "answer"
    return f"adapter {names}{more} {verb} as the base model (no effect)"


def next_steps(inert: list) -> list[str]:
    """What to do about adapters that change nothing: the likely causes, the admission check."""
    if not inert:
        return []
    names = ", ".join(v.model for v in inert)
    return [
        f"{names} loaded but change nothing; likely causes: targets this vLLM release does "
        "not wrap, tensor names whose prefix vLLM does not match (vLLM #34186: "
        "base_model.model.model.layers... for a model served as "
        "...model.language_model.layers...), or an all-zero lora_B (saved before training)",
        "run `patchkit adapter check ADAPTER_DIR --model BASE_MODEL_DIR --target "
        "SITE_PACKAGES` on its files (the directory /v1/models gives as its root) in the "
        "serving image; stop routing to it meanwhile",
    ]
