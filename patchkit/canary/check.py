"""`patchkit canary`: ask a running vLLM server whether each model still answers sanely.

The reports behind patchkit were found late: the server answered 200 while
the text was `!!!!!!`, and once a NaN had appeared every later request could
stay bad until a restart. The canary sends each served model (the base model
and every LoRA adapter that `GET /v1/models` lists) one long prompt, greedy,
with log-probabilities, and judges the answer (patchkit.canary.answers), so
a probe or a cron job notices within minutes and names the adapter at fault;
an adapter whose answer is its base model's changes nothing
(patchkit.canary.effect).

What vLLM answers, read from its code (0.17-0.33; file:line from 0.26.0):

* `GET /v1/models` (openai/models/serving.py:149-165): `{"object": "list",
  "data": [ModelCard...]}`; a card (openai/engine/protocol.py:89-97) has
  `id, object, created, owned_by, root, parent, max_model_len, permission`;
  base models have `parent: null` and their `max_model_len`, LoRA adapters
  have `parent` = the base model's name, `root` = the path they were loaded
  from and `max_model_len: null`.
* `POST /v1/completions` with `logprobs`: `choices[0]` has `text`,
  `logprobs: {text_offset, token_logprobs, tokens, top_logprobs}`,
  `finish_reason`, and with `return_token_ids` the `token_ids` of the
  completion (completion/protocol.py:568-589); `return_tokens_as_token_ids`
  writes each token as `token_id:N` (generate/base/serving.py:273).

The HTTP is patchkit.canary.server's (one deadline for the whole run), the
NaN counter patchkit.canary.metrics'. Requests are sequential and few (per
model one completion, a second one only after a failure, the parent of an
adapter named alone once, and a `/metrics` read), so the canary fits a
readiness probe or a cron job and never loads the server.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError


class DependencyMissing(PatchkitError):
    """A command's optional dependencies are not installed: the ``packages`` to install."""

    code = Code.DEPENDENCY_MISSING


class ServerUnreachable(PatchkitError):
    """No answer from the server at ``url``: refused, timed out, no such host."""

    code = Code.SERVER_UNREACHABLE


class ServerUnauthorized(PatchkitError):
    """The server at ``url`` wants an API key the canary did not give, or another."""

    code = Code.SERVER_UNAUTHORIZED


class NotVllmServer(PatchkitError):
    """The server at ``url`` answered /v1/models with no model list the canary reads
    (``http_status``: its status where that was the trouble)."""

    code = Code.NOT_A_VLLM_SERVER


# The packages by name: `patchkit` on the public index is another project.
MISSING_DEPS = (
    "patchkit canary needs httpx and prometheus-client: "
    "pip install 'httpx>=0.27' 'prometheus-client>=0.20'"
)
try:
    import httpcore  # noqa: F401
    import httpx  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError as exc:  # the optional dependencies are not installed
    raise DependencyMissing(
        MISSING_DEPS, packages=["httpx>=0.27", "prometheus-client>=0.20"]
    ) from exc

# after the dependency check:
from patchkit.canary import answers, effect, fields  # noqa: E402
from patchkit.canary.fields import WrongShape  # noqa: E402
from patchkit.canary.metrics import COUNTER, read_counter  # noqa: E402
from patchkit.canary.prompt import DEFAULT_PROMPT_TOKENS, NEW_TOKENS, prompt_text  # noqa: E402
from patchkit.canary.report import ModelCheck, Report  # noqa: E402
from patchkit.canary.server import (  # noqa: E402
    Server,
    Unanswered,
    Unreadable,
    display_url,
    error_message,
    normalize_url,
)
from patchkit.canary.transport import Deadline  # noqa: E402

DEFAULT_TIMEOUT = 60.0  # seconds for the whole run, so a probe or cron job always ends

MAX_MODELS = 64  # checked per run; a server listing thousands must not outlast --timeout


def failure(kind: type[PatchkitError], message: str, url: str, **facts) -> PatchkitError:
    """The error of its ``kind`` in one line of at most fields.LINE characters (its server
    text already escaped), naming the server's ``url``."""
    return kind(fields.one_line(message, fields.LINE), url=url, **facts)


def list_models(server: Server) -> list[dict]:
    """The model cards of `GET /v1/models`, each with the types the canary relies on;
    a PatchkitError (one line) when the server cannot say or says it wrongly."""
    where = display_url(server.root)
    try:
        answer = server.get("/v1/models")
    except Unreadable as exc:
        raise failure(
            NotVllmServer, f"{where} is not an OpenAI-compatible vLLM server: {exc}", where
        ) from None
    except Unanswered as exc:
        raise failure(
            ServerUnreachable,
            f"cannot reach the vLLM server at {where}: {exc}; is it running, and are the "
            "host and port right?",
            where,
        ) from None
    if answer.status == 401:
        raise failure(
            ServerUnauthorized,
            f"{where} answered 401 Unauthorized on /v1/models: pass the server's API key "
            "with --api-key or VLLM_API_KEY",
            where,
            http_status=401,
        )
    data = answer.json()
    if answer.status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        detail = error_message(answer, server.key) or "no model list"
        raise failure(
            NotVllmServer,
            f"{where} is not an OpenAI-compatible vLLM server: GET /v1/models answered "
            f"HTTP {answer.status} ({detail})",
            where,
            http_status=answer.status,
        )
    try:
        return model_cards(data["data"])
    except WrongShape as exc:
        raise failure(
            NotVllmServer,
            f"{where} answered GET /v1/models with a model list the canary cannot read: "
            f"{fields.one_line(server.scrub(str(exc)))}",
            where,
        ) from None


def model_cards(data: list) -> list[dict]:
    """The cards, first of each id; WrongShape names the first field of the wrong type."""
    by_id: dict[str, dict] = {}
    for index, card in enumerate(data):
        where = f"data[{index}]"
        fields.obj(card, where)
        fields.text(card.get("id"), f"{where}.id")
        fields.text(card.get("parent"), f"{where}.parent", optional=True)
        fields.text(card.get("root"), f"{where}.root", optional=True)
        fields.count(card.get("max_model_len"), f"{where}.max_model_len", optional=True)
        by_id.setdefault(card["id"], card)
    return list(by_id.values())


def server_version(server: Server) -> str | None:
    """vLLM's version from `GET /version`, or None (older servers, proxies, odd answers)."""
    try:
        data = server.get("/version").json()
    except Unanswered:
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return fields.one_line(version, 40) if isinstance(version, str) else None


def request_body(model: str, prompt: str, logprobs: bool) -> dict:
    """Greedy, a few dozen tokens, token ids back; a fresh cache_salt per request.

    The salt keeps the prefix cache from serving the long prompt's prefill
    from memory, which would skip the kernels that go wrong on long prompts.
    Older servers ignore parameters they do not know (extra="allow").
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "cache_salt": secrets.token_hex(8),
    }
    if logprobs:
        body.update(logprobs=1, return_tokens_as_token_ids=True)
    return body


def check_model(server: Server, card: dict, prompt: str) -> ModelCheck:
    """One completion with log-probabilities; after a failure, one without to see the text."""
    verdict = ModelCheck(model=card["id"], parent=card.get("parent"), root=card.get("root"))
    started = server.now()
    try:
        answer = server.post("/v1/completions", request_body(card["id"], prompt, True))
        verdict.http_status = answer.status
        if answer.status == 200:
            answers.judge_completion(verdict, answer, with_logprobs=True)
        else:
            message = error_message(answer, server.key)
            if answers.NAN_MESSAGE.search(message):
                verdict.mark(
                    "bad",
                    Code.CANARY_NAN_ERROR,
                    http_status=answer.status,
                    error=message,
                )
            else:
                verdict.mark(
                    "error",
                    Code.CANARY_HTTP_ERROR,
                    http_status=answer.status,
                    error=message,
                )
            if answer.status != 404:
                look_at_text(server, verdict, card["id"], prompt)
    except Unanswered as exc:
        verdict.mark("error", Code.CANARY_UNANSWERED, error=str(exc))
    verdict.seconds = round(server.now() - started, 2)
    return verdict


def look_at_text(server: Server, verdict: ModelCheck, model: str, prompt: str) -> None:
    """The request again without log-probabilities: no NaN can break its JSON; the text shows."""
    answer = server.post("/v1/completions", request_body(model, prompt, False))
    if answer.status == 200:
        answers.judge_completion(verdict, answer, with_logprobs=False)
    else:
        message = error_message(answer, server.key)
        verdict.add(Code.CANARY_RETRY_FAILED, http_status=answer.status, error=message)


def fitting_prompt(card: dict, by_id: dict[str, dict], wanted: int) -> tuple[int, Reason | None]:
    """Shorten the prompt to fit the model's max_model_len (an adapter uses its parent's).

    The estimate of prompt_text can be off by half for an unusual tokenizer,
    so it keeps that margin; a prompt over the limit would be a 400 that says
    nothing about NaN.
    """
    limit = card.get("max_model_len")
    if limit is None and card.get("parent"):
        limit = by_id.get(card["parent"], {}).get("max_model_len")
    if not isinstance(limit, int) or (wanted + NEW_TOKENS) * 1.5 <= limit:
        return wanted, None
    fitted = max(16, int((limit - NEW_TOKENS) / 1.5))
    return fitted, Reason.of(
        Code.CANARY_PROMPT_SHORTENED, prompt_tokens=fitted, max_model_len=limit
    )


def select(cards: list[dict], wanted: tuple[str, ...]) -> tuple[list[dict], list[ModelCheck]]:
    """The cards to check (all, base models first) and a not-served verdict per unknown --model."""
    if not wanted:
        return sorted(cards, key=lambda c: bool(c.get("parent"))), []
    by_id = {c["id"]: c for c in cards}
    # the first few the server lists, and how many (a server may list thousands)
    served = Reason.of(Code.CANARY_NOT_SERVED, served=list(by_id)[:5], served_count=len(by_id))
    missing = [
        ModelCheck(model=name, verdict="not-served", evidence=[served])
        for name in dict.fromkeys(wanted)
        if name not in by_id
    ]
    return [by_id[name] for name in dict.fromkeys(wanted) if name in by_id], missing


def run(
    url: str,
    api_key: str | None = None,
    models: tuple[str, ...] = (),
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    timeout: float = DEFAULT_TIMEOUT,
    record: Path | None = None,
    clock: Callable[[], float] | None = None,
) -> Report:
    """Check every model (or the ones named), one after the other, within ``timeout`` seconds.

    At most MAX_MODELS are checked; the rest are named in a note. ``clock``
    (time.monotonic by default) is what the deadline reads, so tests can move
    it instead of waiting.
    """
    deadline = Deadline(timeout, clock or time.monotonic)
    started = deadline.clock()
    root = normalize_url(url)
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
    server = Server(root, api_key or None, deadline, record)
    report = Report(url=display_url(root), prompt_tokens=prompt_tokens)
    try:
        cards = list_models(server)
        by_id = {c["id"]: c for c in cards}
        report.version = server_version(server)
        targets, missing = select(cards, models)
        if len(targets) > MAX_MODELS:
            report.skipped = [c["id"] for c in targets[MAX_MODELS:]]
            targets = targets[:MAX_MODELS]
            report.notes.append(
                Reason.of(
                    Code.CANARY_MODELS_SKIPPED,
                    count=len(report.skipped),
                    most=MAX_MODELS,
                    models=report.skipped[:3],  # the first few, named (the count says all)
                )
            )
        reading = read_counter(server)
        report.counter = {"name": COUNTER, "present": reading.value is not None}
        report.counter.update(before=reading.value, after=reading.value)
        if reading.why:
            report.notes.append(reading.why)
        for card in targets:
            report.models.append(check_one(server, report, card, by_id, prompt_tokens))
        report.parents = ask_parents(server, report, by_id, prompt_tokens)
        effect.judge_effects(report.models, report.parents)
        report.models += missing
        if not report.models:
            report.notes.append(Reason.of(Code.CANARY_NO_MODELS))
        recheck_base(server, report, by_id, prompt_tokens)
    finally:
        server.close()
    report.seconds = deadline.clock() - started
    return report


def check_one(server: Server, report: Report, card: dict, by_id: dict, tokens: int):
    """One model's verdict, with the counter read after its requests."""
    if server.remaining() <= 0:
        return ModelCheck(
            model=card["id"],
            parent=card.get("parent"),
            verdict="not-checked",
            evidence=[Reason.of(Code.CANARY_NOT_CHECKED)],
        )
    fitted, note = fitting_prompt(card, by_id, tokens)
    verdict = check_model(server, card, prompt_text(fitted))
    if note:
        verdict.evidence.append(note)
    if report.counter["present"]:
        judge_counter(server, report, verdict)
    return verdict


def ask_parents(server: Server, report: Report, by_id: dict, tokens: int) -> list[ModelCheck]:
    """The parents of checked adapters that were not checked themselves (--model named only
    the adapter): asked once, the same prompt, so the adapter's answer has its comparison."""
    checked = {v.model for v in report.models}
    wanted = [v.parent for v in report.models if v.parent and v.verdict == "ok"]
    asked = []
    for name in dict.fromkeys(wanted):
        if name in checked or name not in by_id or server.remaining() <= 0:
            continue
        fitted, _ = fitting_prompt(by_id[name], by_id, tokens)
        asked.append(check_model(server, by_id[name], prompt_text(fitted)))
    return asked


def judge_counter(server: Server, report: Report, verdict: ModelCheck) -> None:
    """A rise of the counter while the model's requests ran is bad; a counter that turned
    unreadable (NaN) is an error, since it could hide one."""
    before = report.counter["after"]
    reading = read_counter(server)
    if reading.value is None:
        if reading.unreadable:
            verdict.mark_reason("error", reading.why)
        else:
            verdict.evidence.append(reading.why)
        return
    report.counter["after"] = reading.value
    verdict.corrupted_delta = reading.value - before
    if reading.value > before:
        verdict.mark(
            "bad",
            Code.CANARY_COUNTER_ROSE,
            counter=COUNTER,
            rise=reading.value - before,
        )


def recheck_base(server: Server, report: Report, by_id: dict, tokens: int) -> None:
    """After a bad adapter, ask a sane base model again: confined, or is the server polluted?"""
    base = next((v for v in report.models if v.kind == "base" and v.verdict == "ok"), None)
    bad_adapter = any(v.kind == "adapter" and v.verdict == "bad" for v in report.models)
    if base is None or not bad_adapter or server.remaining() <= 0:
        return
    report.recheck = check_one(server, report, by_id[base.model], by_id, tokens)
