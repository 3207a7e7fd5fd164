"""The words of the canary's codes: what one model's answer showed, the notes of a run, its
one-line verdict and what to do next (:mod:`patchkit.cli.words` takes them into its own
registry, as it does doctor's and probe report's).

Names, errors and texts in the facts come from the server: the words escape and cut
each of them (:func:`patchkit.canary.fields.one_line`), as the canary always did; the
command line scrubs the API key from the lines and cuts each to one line.
"""

from __future__ import annotations

from patchkit.canary import fields
from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


def say(reason: Reason) -> str:
    """The words of one of the canary's reasons."""
    return WORDS[reason.code](reason, "")


def some_names(names, count: int) -> str:
    """The names shown (each cut short) and how many more of ``count``: a bounded list."""
    listed = ", ".join(fields.one_line(n, 40) for n in names) or "nothing"
    return listed + (f" and {count - len(names)} more" if count > len(names) else "")


def _of(r: Reason) -> str:
    return f"{r['count']} of {r['total']} log-probabilities"


# ----- what one model's answer showed -----


@words(Code.CANARY_NAN_ERROR)
def _nan_error(r: Reason, _: str) -> str:
    return f"HTTP {r['http_status']}: '{r['error']}' (NaN log-probabilities)"


@words(Code.CANARY_HTTP_ERROR)
def _http_error(r: Reason, _: str) -> str:
    return f"HTTP {r['http_status']}: '{r['error']}'"


@words(Code.CANARY_RETRY_FAILED)
def _retry_failed(r: Reason, _: str) -> str:
    return f"without logprobs too: HTTP {r['http_status']}: '{r['error']}'"


@words(Code.CANARY_UNANSWERED)
def _unanswered(r: Reason, _: str) -> str:
    return r["error"]


@words(Code.CANARY_ANSWER_SHAPE)
def _answer_shape(r: Reason, _: str) -> str:
    return f"HTTP {r['http_status']} but {fields.one_line(r['problem'])}"


@words(Code.CANARY_ZERO_RUN)
def _zero_run(r: Reason, _: str) -> str:
    return f"{r['run']} tokens of id 0 in a row ('!' in Qwen tokenizers)"


@words(Code.CANARY_BANG_TEXT)
def _bang_text(r: Reason, _: str) -> str:
    return f"the text is a run of '!': {fields.one_line(r['text'], 40)!r}"


@words(Code.CANARY_LOGPROBS_ABSENT)
def _logprobs_absent(r: Reason, _: str) -> str:
    return "no log-probabilities in the answer (logprobs were asked for)"


@words(Code.CANARY_LOGPROBS_NAN)
def _logprobs_nan(r: Reason, _: str) -> str:
    return f"{_of(r)} are NaN"


@words(Code.CANARY_LOGPROBS_INFINITE)
def _logprobs_infinite(r: Reason, _: str) -> str:
    return f"{_of(r)} are infinite (vLLM writes -inf as -9999.0, and none is ever +inf)"


@words(Code.CANARY_LOGPROBS_POSITIVE)
def _logprobs_positive(r: Reason, _: str) -> str:
    return f"{_of(r)} are positive (largest {r['largest']:.6g}; a log-probability is never above 0)"


@words(Code.CANARY_LOGPROBS_NULL)
def _logprobs_null(r: Reason, _: str) -> str:
    return f"{_of(r)} missing (null)"


@words(Code.CANARY_LOGPROB_IMPOSSIBLE)
def _logprob_impossible(r: Reason, _: str) -> str:
    return (
        f"greedy token with log-probability {r['lowest']} (a sane argmax is above "
        f"{r['floor']:.0f}; vLLM writes -inf as -9999.0)"
    )


@words(Code.CANARY_COUNTER_ROSE)
def _counter_rose(r: Reason, _: str) -> str:
    return (
        f"{r['counter']} rose by {r['rise']:g} while its requests ran (other traffic on the "
        "server counts too)"
    )


@words(Code.CANARY_NO_EFFECT)
def _no_effect(r: Reason, _: str) -> str:
    return (
        f"the same {r['tokens']} greedy tokens as its base model "
        f"'{fields.one_line(r['parent'], 60)}', log-probabilities at most "
        f"{r['max_logprob_difference']:.2g} apart (the server's repeat noise: "
        f"{r['repeat_noise']:g}): the adapter changes nothing"
    )


@words(Code.CANARY_NOT_SERVED)
def _not_served(r: Reason, _: str) -> str:
    return f"not in GET /v1/models (served: {some_names(r['served'], r['served_count'])})"


@words(Code.CANARY_NOT_CHECKED)
def _not_checked(r: Reason, _: str) -> str:
    return "the time budget (--timeout) ran out before this model"


@words(Code.CANARY_PROMPT_SHORTENED)
def _prompt_shortened(r: Reason, _: str) -> str:
    return (
        f"prompt shortened to about {r['prompt_tokens']} tokens to fit max_model_len "
        f"{r['max_model_len']}"
    )


# ----- notes of a run: the counter, /metrics, the models -----


@words(Code.CANARY_COUNTER_ABSENT)
def _counter_absent(r: Reason, _: str) -> str:
    return (
        f"{r['counter']} is not on /metrics: start the server with "
        "VLLM_COMPUTE_NANS_IN_LOGITS=1 so requests with NaN logits are counted"
    )


@words(Code.CANARY_METRICS_NOT_READ)
def _metrics_not_read(r: Reason, _: str) -> str:
    return f"/metrics not read: {r['error']}"


@words(Code.CANARY_METRICS_HTTP_STATUS)
def _metrics_status(r: Reason, _: str) -> str:
    return f"/metrics answered HTTP {r['http_status']}"


@words(Code.CANARY_COUNTER_TOO_LONG)
def _counter_too_long(r: Reason, _: str) -> str:
    return f"{r['counter']} has more than {r['most']} lines on /metrics: unreadable"


@words(Code.CANARY_COUNTER_NOT_PROMETHEUS)
def _counter_not_prometheus(r: Reason, _: str) -> str:
    error = f"{r['error_type']}: {r['error']}"
    return fields.one_line(f"{r['counter']} on /metrics is not Prometheus text ({error})")


@words(Code.CANARY_COUNTER_UNREADABLE)
def _counter_unreadable(r: Reason, _: str) -> str:
    return (
        f"{r['counter']} on /metrics is {r['value']}, not a count: unreadable, so a rise in "
        "it cannot be seen"
    )


@words(Code.CANARY_MODELS_SKIPPED)
def _models_skipped(r: Reason, _: str) -> str:
    return (
        f"{r['count']} more models not checked (at most {r['most']} a run; name them with "
        f"--model): {some_names(r['models'], r['count'])}"
    )


@words(Code.CANARY_NO_MODELS)
def _no_models(r: Reason, _: str) -> str:
    return "the server lists no models"


# ----- the verdict of a run, in one line -----


@words(Code.CANARY_OK)
def _ok(r: Reason, _: str) -> str:
    n, skipped = r["count"], r["skipped"]
    sane = f"all {n} models answer sanely" if n != 1 else "the 1 model answers sanely"
    return sane + (f" ({skipped} more not checked)" if skipped else "")


@words(Code.CANARY_FAILED)
def _failed(r: Reason, _: str) -> str:
    """What is wrong, in at most fields.LINE characters (names and evidence escaped, cut)."""
    parts = []
    bad = r["bad"]
    if bad:
        names = ", ".join(f"{v['kind']} '{fields.one_line(v['model'], 60)}'" for v in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        parts.append(f"{names}{more} answer{'s' if len(bad) == 1 else ''} NaN")
    if r["no_effect"]:
        parts.append(_inert(r["no_effect"]))
    if r["polluted"] is not None:
        parts.append(f"the base model '{fields.one_line(r['polluted'], 60)}' went bad after it")
    others = r["others"]
    for v in others[:3]:
        evidence = say(v["evidence"]) if v["evidence"] is not None else ""
        parts.append(f"'{fields.one_line(v['model'], 60)}' {v['verdict']}: {evidence}")
    if len(others) > 3:
        parts.append(f"{len(others) - 3} more not ok")
    return fields.one_line("; ".join(parts), fields.LINE)


def _inert(inert) -> str:
    """The part of the verdict about adapters that change nothing."""
    names = ", ".join(f"'{fields.one_line(name, 60)}'" for name in inert[:3])
    more = f" and {len(inert) - 3} more" if len(inert) > 3 else ""
    verb = "answers" if len(inert) == 1 else "answer"
    return f"adapter {names}{more} {verb} as the base model (no effect)"


# ----- what to do next -----


@words(Code.CANARY_STEP_DOCTOR)
def _step_doctor(r: Reason, _: str) -> str:
    return (
        f"the NaN comes through the LoRA path of {', '.join(r['adapters'])} (the base model "
        f"is sane): run `{r['command']}` in the serving image (the Python that runs vLLM); it "
        "says whether vLLM #48590 (Hopper LoRA kernel) is exposed"
    )


@words(Code.CANARY_STEP_APPLY)
def _step_apply(r: Reason, _: str) -> str:
    return f"if exposed: `{r['command']}`, then restart the server"


@words(Code.CANARY_STEP_REPLACE_ADAPTER)
def _step_replace(r: Reason, _: str) -> str:
    return (
        f"if protected: the weights of {', '.join(r['adapters'])} themselves hold inf/NaN "
        "(patchkit's torch LoRA path keeps such an adapter's NaN in its own requests); "
        "replace the adapter, and stop routing to it meanwhile (POST "
        "/v1/unload_lora_adapter when the server allows runtime LoRA updates)"
    )


@words(Code.CANARY_STEP_BASE_NAN)
def _step_base_nan(r: Reason, _: str) -> str:
    return (
        "the base model itself answers NaN, so LoRA is not the only cause: run "
        "`patchkit doctor` in the serving image and `patchkit apply --clear-caches`"
    )


@words(Code.CANARY_STEP_NO_EFFECT)
def _step_no_effect(r: Reason, _: str) -> str:
    one = len(r["adapters"]) == 1
    return (
        f"{', '.join(r['adapters'])} {'is' if one else 'are'} served but change"
        f"{'s' if one else ''} nothing; likely causes: targets this vLLM release does not "
        "wrap, a name prefix it does not match (vLLM #34186: trained on the text-only "
        "model, served on the multimodal one), an all-zero lora_B; stop routing to "
        f"{'it' if one else 'them'} meanwhile"
    )


@words(Code.CANARY_STEP_ADAPTER_CHECK)
def _step_adapter_check(r: Reason, _: str) -> str:
    return (
        f"in the serving image: `{r['command']}` (SITE_PACKAGES: the directory that holds "
        "vllm/); it names the modules the release would not wrap and all-zero factors"
    )


@words(Code.CANARY_STEP_POLLUTED)
def _step_polluted(r: Reason, _: str) -> str:
    return "the base model went bad after the adapter: the server's state is polluted"


@words(Code.CANARY_STEP_RESTART)
def _step_restart(r: Reason, _: str) -> str:
    return (
        "restart the server: once a NaN has appeared, later requests can stay bad until a restart"
    )


@words(Code.CANARY_STEP_SERVER_LOG)
def _step_server_log(r: Reason, _: str) -> str:
    return "look at the server's log for the failed requests; check --timeout"


@words(Code.CANARY_STEP_MODEL_NAMES)
def _step_model_names(r: Reason, _: str) -> str:
    return "check the --model names against GET /v1/models (listed in the evidence)"


@words(Code.CANARY_STEP_COUNTER)
def _step_counter(r: Reason, _: str) -> str:
    return (
        "start the server with VLLM_COMPUTE_NANS_IN_LOGITS=1 so the next NaN is also "
        f"counted in {r['counter']}"
    )
