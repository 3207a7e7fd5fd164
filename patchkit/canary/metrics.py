"""vLLM's NaN counter on /metrics: `vllm:corrupted_requests_total`, read and summed.

`vllm:corrupted_requests` (vLLM 0.26.0 v1/metrics/loggers.py:571-582)
exists only when the server runs with `VLLM_COMPUTE_NANS_IN_LOGITS=1`;
prometheus_client exports it as `vllm:corrupted_requests_total`, one sample
per `model_name`/`engine`, incremented when a request with NaN logits ends.
Why prometheus_client's parser: the exposition format has escapes, labels,
`_total`/`_created` samples and comments that a regular expression gets wrong.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from patchkit.canary.server import Server, Unanswered
from patchkit.codes import Code, Reason

MAX_COUNTER_LINES = 1024  # of /metrics lines about the counter: one per model and engine
COUNTER = "vllm:corrupted_requests_total"
COUNTER_SAMPLES = (COUNTER, "vllm:corrupted_requests")  # without _total from other exporters
COUNTER_LINES = tuple(  # the /metrics lines that can be about the counter
    f"{lead}vllm:corrupted_requests" for lead in ("", "# TYPE ", "# HELP ")
)
COUNTER_ABSENT = Reason.of(Code.CANARY_COUNTER_ABSENT, counter=COUNTER)


class Reading(NamedTuple):
    """What one read of the counter gave: a finite value, or None and why (unreadable:
    the counter is there but is no count, which could hide a rise)."""

    value: float | None
    why: Reason | None = None
    unreadable: bool = False


def read_counter(server: Server) -> Reading:
    """The sum of vllm:corrupted_requests_total over engines and models, or why not.

    Only the counter's own lines are parsed (a /metrics page of megabytes
    costs the parser seconds), at most MAX_COUNTER_LINES of them. A NaN or
    infinite sample makes the sum meaningless: NaN compares false with
    everything, so `after > before` could never show a rise.
    """
    try:
        answer = server.get("/metrics")
    except Unanswered as exc:
        return Reading(None, Reason.of(Code.CANARY_METRICS_NOT_READ, error=str(exc)))
    if answer.status != 200:
        return Reading(None, Reason.of(Code.CANARY_METRICS_HTTP_STATUS, http_status=answer.status))
    lines = [line for line in answer.body.splitlines() if line.startswith(COUNTER_LINES)]
    if len(lines) > MAX_COUNTER_LINES:
        why = Reason.of(Code.CANARY_COUNTER_TOO_LONG, counter=COUNTER, most=MAX_COUNTER_LINES)
        return Reading(None, why, unreadable=True)
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser raises ValueError and others on bad text
        why = Reason.of(
            Code.CANARY_COUNTER_NOT_PROMETHEUS,
            counter=COUNTER,
            error_type=type(exc).__name__,
            error=str(exc),
        )
        return Reading(None, why, unreadable=True)
    samples = [s for f in families for s in f.samples if s.name in COUNTER_SAMPLES]
    if not samples:
        return Reading(None, COUNTER_ABSENT)
    odd = [s.value for s in samples if not math.isfinite(s.value)]
    if odd:
        # the value as text: NaN and infinity are no JSON numbers
        why = Reason.of(Code.CANARY_COUNTER_UNREADABLE, counter=COUNTER, value=str(odd[0]))
        return Reading(None, why, unreadable=True)
    return Reading(sum(s.value for s in samples))
