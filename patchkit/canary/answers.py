"""One completion judged: the signs of NaN in what a model answered.

A NaN log-probability survives `max(logprob, -9999.0)` (vLLM 0.26.0
completion/serving.py:703) and makes Starlette's JSON encoder raise
`ValueError: Out of range float values are not JSON compliant` (Python
3.13+ appends `: nan`) when the response is built (completion/
api_router.py:61). vLLM 0.18+ maps that ValueError to HTTP **400**
`{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`
(api_server.py:300, serve/utils/server_utils.py:382,
serve/utils/error_response.py:61); 0.17 has no handler for it and answers a
plain-text 500 `Internal Server Error`. So the canary judges the message,
not the status (patchkit.canary.check), and after any failed request asks
once more without log-probabilities to see the text (a run of `!`, token id
0 in Qwen), judged here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from patchkit.canary import fields
from patchkit.canary.fields import WrongShape
from patchkit.canary.report import ModelCheck
from patchkit.canary.server import Exchange
from patchkit.codes import Code
from patchkit.symptoms import ZERO_RUN_PROSE, longest_zero_run

# Greedy decoding after a NaN emits token id 0 (`!` in Qwen tokenizers) at every
# step: patchkit.symptoms.ZERO_RUN_PROSE in a row is the symptom here.
BANG_RUN = "!" * ZERO_RUN_PROSE

# The greedy token is the argmax, so its log-probability is at least
# -ln(vocabulary), about -12.5 for 260k tokens; far below means broken logits
# (vLLM floors -inf to -9999.0).
MIN_GREEDY_LOGPROB = -100.0

NAN_MESSAGE = re.compile(r"not JSON compliant|\bnan\b|\binf(inity)?\b", re.IGNORECASE)

TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@dataclass
class Completion:
    """The fields of a completion the canary judges, each of the type vLLM writes."""

    text: str
    token_ids: list[int] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    logprobs: list[float | None] | None  # None: the answer has none


def read_completion(data: object) -> Completion:
    """`choices[0]` and `usage` of a completion; WrongShape names a field of the wrong type."""
    if data is None:
        raise WrongShape("the answer is not JSON (or nested too deeply)")
    answer = fields.obj(data, "the answer")
    choices = fields.items(answer.get("choices"), "choices")
    if not choices:
        raise WrongShape("choices is empty")
    choice = fields.obj(choices[0], "choices[0]")
    logprobs = fields.obj(choice.get("logprobs"), "choices[0].logprobs", optional=True) or {}
    usage = fields.obj(answer.get("usage"), "usage", optional=True) or {}
    values = logprobs.get("token_logprobs")
    where = "choices[0].logprobs.token_logprobs"
    return Completion(
        text=fields.text(choice.get("text"), "choices[0].text"),
        token_ids=token_ids(choice, logprobs),
        prompt_tokens=fields.count(usage.get("prompt_tokens"), "usage.prompt_tokens", True),
        completion_tokens=fields.count(
            usage.get("completion_tokens"), "usage.completion_tokens", True
        ),
        logprobs=None if values is None else fields.numbers(values, where),
    )


def judge_completion(verdict: ModelCheck, answer: Exchange, with_logprobs: bool) -> None:
    """Token-id-0 or `!` runs, NaN, missing or impossible log-probabilities."""
    try:
        completion = read_completion(answer.json())
    except WrongShape as exc:
        verdict.mark(
            "error",
            Code.CANARY_ANSWER_SHAPE,
            http_status=answer.status,
            problem=str(exc),
        )
        return
    verdict.text = completion.text
    verdict.token_ids = completion.token_ids
    if completion.prompt_tokens is not None:
        verdict.prompt_tokens = completion.prompt_tokens
    if completion.completion_tokens is not None:
        verdict.completion_tokens = completion.completion_tokens
    run = longest_zero_run(verdict.token_ids or [])
    if run >= ZERO_RUN_PROSE:
        verdict.mark(
            "bad",
            Code.CANARY_ZERO_RUN,
            run=run,
        )
    elif verdict.token_ids is None and BANG_RUN in verdict.text:
        verdict.mark(
            "bad",
            Code.CANARY_BANG_TEXT,
            text=verdict.text[:80],  # what its words show of it, at most
        )
    if with_logprobs:
        verdict.logprobs = completion.logprobs
        judge_logprobs(verdict, completion.logprobs)


def judge_logprobs(verdict: ModelCheck, values: list[float | None] | None) -> None:
    """Bad: none, null entries, NaN, infinite, positive (a log-probability is at most 0)
    or far below what a greedy token can have."""
    if not values:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROBS_ABSENT,
        )
        return
    numbers = [v for v in values if v is not None]
    missing = len(values) - len(numbers)
    nan = sum(1 for v in numbers if math.isnan(v))
    infinite = sum(1 for v in numbers if math.isinf(v))
    positive = [v for v in numbers if math.isfinite(v) and v > 0]
    floor = [v for v in numbers if math.isfinite(v) and v < MIN_GREEDY_LOGPROB]
    if nan:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROBS_NAN,
            count=nan,
            total=len(values),
        )
    if infinite:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROBS_INFINITE,
            count=infinite,
            total=len(values),
        )
    if positive:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROBS_POSITIVE,
            count=len(positive),
            total=len(values),
            largest=max(positive),
        )
    if missing:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROBS_NULL,
            count=missing,
            total=len(values),
        )
    if floor:
        verdict.mark(
            "bad",
            Code.CANARY_LOGPROB_IMPOSSIBLE,
            lowest=min(floor),
            floor=MIN_GREEDY_LOGPROB,
        )


def token_ids(choice: dict, logprobs: dict) -> list[int] | None:
    """The completion's token ids: `token_ids`, else the `token_id:N` tokens of logprobs."""
    ids = fields.counts(choice.get("token_ids"), "choices[0].token_ids", optional=True)
    if ids is not None:
        return ids
    tokens = fields.texts(logprobs.get("tokens"), "choices[0].logprobs.tokens", optional=True)
    if tokens:
        found = [TOKEN_ID.match(t) for t in tokens]
        if all(found):
            return [int(m.group(1)) for m in found]
    return None
