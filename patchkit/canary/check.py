"""`patchkit canary`: ask a running vLLM server whether each model still answers sanely.

The reports behind patchkit were found late: the server answered 200 while
the text was `!!!!!!`, and once a NaN had appeared every later request could
stay bad until a restart. The canary sends each served model (the base model
and every LoRA adapter that `GET /v1/models` lists) one long prompt, greedy,
with log-probabilities, and judges the answer, so a probe or a cron job
notices within minutes and names the adapter at fault.

What vLLM answers, read from its code (0.17-0.33; file:line from 0.26.0):

* `GET /v1/models` (openai/models/serving.py:149-165): `{"object": "list",
  "data": [ModelCard...]}`; a card (openai/engine/protocol.py:89-97) has
  `id, object, created, owned_by, root, parent, max_model_len, permission`;
  base models have `parent: null` and their `max_model_len`, LoRA adapters
  have `parent` = the base model's name and `max_model_len: null`.
* `POST /v1/completions` with `logprobs`: `choices[0]` has `text`,
  `logprobs: {text_offset, token_logprobs, tokens, top_logprobs}`,
  `finish_reason`, and with `return_token_ids` the `token_ids` of the
  completion (completion/protocol.py:568-589); `return_tokens_as_token_ids`
  writes each token as `token_id:N` (generate/base/serving.py:273).
* A NaN log-probability survives `max(logprob, -9999.0)`
  (completion/serving.py:703) and makes Starlette's JSON encoder raise
  `ValueError: Out of range float values are not JSON compliant` (Python
  3.13+ appends `: nan`) when the response is built (completion/
  api_router.py:61). vLLM 0.18+ maps that ValueError to HTTP **400**
  `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`
  (api_server.py:300, serve/utils/server_utils.py:382,
  serve/utils/error_response.py:61); 0.17 has no handler for it and answers a
  plain-text 500 `Internal Server Error`. So the canary judges the message,
  not the status, and after any failed request asks once more without
  log-probabilities to see the text (a run of `!`, token id 0 in Qwen).
* `vllm:corrupted_requests` (v1/metrics/loggers.py:571-582) exists only when
  the server runs with `VLLM_COMPUTE_NANS_IN_LOGITS=1`; prometheus_client
  exports it as `vllm:corrupted_requests_total`, one sample per
  `model_name`/`engine`, incremented when a request with NaN logits ends.
* An API key (`--api-key` / `VLLM_API_KEY` on the server) guards `/v1/*`; a
  wrong one gets 401 `{"error": "Unauthorized"}` (server_utils.py:91).

Why httpx's transport, httpcore: one small dependency, the raw status and
body of every answer, and a pluggable network backend, so each socket
operation gets only the time the run's deadline leaves (patchkit.canary.
transport; a timeout per request is no bound on a server that trickles).
The body comes undecoded and is decoded under a cap (patchkit.canary.
decoding). The official openai client is larger, retries on its own, and
turns a 500's body into an exception that hides it. Why prometheus_client's
parser: the exposition format has escapes, labels, `_total`/`_created`
samples and comments that a regular expression gets wrong.

Requests are sequential and few (per model one completion, a second one only
after a failure, and a `/metrics` read), so the canary fits a readiness probe
or a cron job and never loads the server.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from patchkit.errors import PatchkitError
from patchkit.symptoms import ZERO_RUN_PROSE, longest_zero_run

# The packages by name: `patchkit` on the public index is another project.
MISSING_DEPS = (
    "patchkit canary needs httpx and prometheus-client: "
    "pip install 'httpx>=0.27' 'prometheus-client>=0.20'"
)
try:
    import httpcore
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:  # the optional dependencies are not installed
    raise PatchkitError(MISSING_DEPS) from exc

# after the dependency check:
from patchkit.canary import effect, fields, transport  # noqa: E402
from patchkit.canary.decoding import ACCEPTED, CappedBody, DecodeError, TooLarge  # noqa: E402
from patchkit.canary.fields import WrongShape  # noqa: E402
from patchkit.canary.transport import Deadline  # noqa: E402

DEFAULT_PROMPT_TOKENS = 2000
DEFAULT_TIMEOUT = 60.0  # seconds for the whole run, so a probe or cron job always ends
NEW_TOKENS = 32
CONNECT_TIMEOUT = 5.0  # a refused or unroutable address fails fast, not at the deadline
MAX_BODY = 16 * 1024 * 1024  # decoded bytes of one answer: a wrong URL must not fill memory
MAX_MODELS = 64  # checked per run; a server listing thousands must not outlast --timeout
MAX_COUNTER_LINES = 1024  # of /metrics lines about the counter: one per model and engine
# Greedy decoding after a NaN emits token id 0 (`!` in Qwen tokenizers) at every
# step: patchkit.symptoms.ZERO_RUN_PROSE in a row is the symptom here.
BANG_RUN = "!" * ZERO_RUN_PROSE
# The greedy token is the argmax, so its log-probability is at least
# -ln(vocabulary), about -12.5 for 260k tokens; far below means broken logits
# (vLLM floors -inf to -9999.0).
MIN_GREEDY_LOGPROB = -100.0
COUNTER = "vllm:corrupted_requests_total"
COUNTER_SAMPLES = (COUNTER, "vllm:corrupted_requests")  # without _total from other exporters
COUNTER_LINES = tuple(  # the /metrics lines that can be about the counter
    f"{lead}vllm:corrupted_requests" for lead in ("", "# TYPE ", "# HELP ")
)
NAN_MESSAGE = re.compile(r"not JSON compliant|\bnan\b|\binf(inity)?\b", re.IGNORECASE)
TOKEN_ID = re.compile(r"^token_id:(\d+)$")
COUNTER_ABSENT = (
    f"{COUNTER} is not on /metrics: start the server with VLLM_COMPUTE_NANS_IN_LOGITS=1 "
    "so requests with NaN logits are counted"
)


class Unanswered(Exception):
    """A request got no HTTP answer (refused, timed out, budget spent); str() says which."""


class Unreadable(Unanswered):
    """An answer came but cannot be taken: too large, or its encoding broken or unknown."""


@dataclass
class Exchange:
    """One HTTP request and its answer, as recorded with --record."""

    method: str
    path: str
    request: dict | None
    status: int
    body: str
    seconds: float

    @cached_property
    def data(self) -> object:
        """The body as JSON, or None (not JSON, nested too deeply); parsed once."""
        return fields.parse(self.body)

    def json(self) -> object:
        return self.data


@dataclass
class ModelCheck:
    """What one model answered and what the canary makes of it.

    verdict: ok, bad (evidence of NaN: the failure this tool exists for),
    error (the request failed some other way), not-served (a --model the
    server does not list), not-checked (the time budget ran out first).
    """

    model: str
    parent: str | None = None
    verdict: str = "ok"
    evidence: list[str] = field(default_factory=list)
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    corrupted_delta: float | None = None
    seconds: float = 0.0

    @property
    def kind(self) -> str:
        return "adapter" if self.parent else "base"

    def mark(self, verdict: str, evidence: str) -> None:
        """Add evidence; `bad` outranks `error`, which outranks `ok`."""
        order = ("ok", "error", "bad")
        if verdict in order and order.index(verdict) > order.index(self.verdict):
            self.verdict = verdict
        elif verdict not in order:
            self.verdict = verdict
        self.evidence.append(evidence)


@dataclass
class Report:
    url: str
    version: str | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    models: list[ModelCheck] = field(default_factory=list)
    recheck: ModelCheck | None = None  # the base model again, after a bad adapter
    parents: list[ModelCheck] = field(default_factory=list)  # asked only to compare adapters
    counter: dict = field(default_factory=dict)  # name, present, before, after
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # listed, past MAX_MODELS: not checked
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        checked = self.models + ([self.recheck] if self.recheck else [])
        return bool(self.models) and all(v.verdict == "ok" for v in checked)

    def summary(self) -> str:
        """One line of at most fields.LINE characters: what is wrong (or that all is well).

        Model names and evidence come from the server: each is escaped and cut,
        and so is the whole line.
        """
        if self.ok:
            more = f" ({len(self.skipped)} more not checked)" if self.skipped else ""
            n = len(self.models)
            sane = f"all {n} models answer sanely" if n != 1 else "the 1 model answers sanely"
            return sane + more
        bad = [v for v in self.models if v.verdict == "bad"]
        inert = [v for v in self.models if v.verdict == effect.NO_EFFECT]
        others = [v for v in self.models if v.verdict not in ("ok", "bad", effect.NO_EFFECT)]
        parts = []
        if bad:
            names = ", ".join(f"{v.kind} '{fields.one_line(v.model, 60)}'" for v in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            parts.append(f"{names}{more} answer{'s' if len(bad) == 1 else ''} NaN")
        if inert:
            parts.append(effect.summary(inert))
        if self.recheck and self.recheck.verdict != "ok":
            name = fields.one_line(self.recheck.model, 60)
            parts.append(f"the base model '{name}' went bad after it")
        for v in others[:3]:
            evidence = v.evidence[0] if v.evidence else ""
            parts.append(f"'{fields.one_line(v.model, 60)}' {v.verdict}: {evidence}")
        if len(others) > 3:
            parts.append(f"{len(others) - 3} more not ok")
        return fields.one_line("; ".join(parts), fields.LINE)

    def next_steps(self) -> list[str]:
        return next_steps(self)


# ----- the prompt -----

_SUBJECTS = (
    "The old lighthouse keeper", "A young engineer", "The village baker", "Our neighbour",
    "The river pilot", "A tired nurse", "The school librarian", "My grandmother",
    "The orchestra conductor", "A travelling merchant", "The night watchman", "Her brother",
    "The apprentice carpenter", "A retired sailor", "The museum guide", "The farmer's daughter",
)  # fmt: skip
_VERBS = (
    "carried", "repaired", "painted", "described", "counted", "borrowed", "measured",
    "planted", "cleaned", "remembered", "explained", "collected", "followed", "opened",
    "wrapped", "studied", "sold", "watched", "built", "tested",
)  # fmt: skip
_OBJECTS = (
    "a wooden chair", "the broken clock", "seven copper pans", "an old map of the coast",
    "the letters from the city", "a basket of green apples", "the heavy iron gate",
    "a small blue boat", "the winter coats", "a box of candles", "the garden fence",
    "two bags of flour", "the station bell", "a long wool scarf", "the kitchen window",
)  # fmt: skip
_PLACES = (
    "near the harbour", "behind the market", "in the quiet library", "along the north road",
    "under the bridge", "at the top of the hill", "beside the mill", "in the crowded square",
    "across the valley", "inside the warm kitchen", "by the frozen lake", "on the morning train",
)  # fmt: skip
_TIMES = (
    "before sunrise", "late in the evening", "on a rainy Tuesday", "after the long winter",
    "during the spring fair", "just after lunch", "on the first day of autumn",
    "while the bells rang", "when the snow stopped", "at half past nine",
)  # fmt: skip
_REASONS = (
    "because the mayor had asked for it", "so that the children could see it",
    "although nobody had noticed", "since the weather was finally calm",
    "because the old one had worn out", "as the whole town expected",
    "even though it took most of the day", "because a storm was coming",
)  # fmt: skip


def prompt_text(tokens: int) -> str:
    """Deterministic, varied English prose of about ``tokens`` tokens, with no tokenizer.

    Built from common words that BPE vocabularies hold whole (with their
    leading space), so the estimate is one token per word and per punctuation
    mark; `usage.prompt_tokens` in each answer tells the real count. Varied
    so the model has something to continue and no run of repeats, and the
    same on every run (the prefix cache is defeated with `cache_salt`).
    """
    rnd = random.Random(20)  # fixed: the same text every run
    lead = "Here is a long story from a small town. Read it and continue it."
    words, text, paragraph = _estimate(lead), [lead, ""], []
    while True:
        sentence = (
            f"{rnd.choice(_TIMES).capitalize()}, {rnd.choice(_SUBJECTS).lower()} "
            f"{rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)} {rnd.choice(_PLACES)}, "
            f"{rnd.choice(_REASONS)}."
            if rnd.random() < 0.5
            else f"{rnd.choice(_SUBJECTS)} {rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)} "
            f"{rnd.choice(_PLACES)} {rnd.choice(_TIMES)}, {rnd.choice(_REASONS)}."
        )
        cost = _estimate(sentence)
        if words + cost > tokens - 4 and (paragraph or len(text) > 2):
            break
        paragraph.append(sentence)
        words += cost
        if len(paragraph) == 5:
            text.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        text.append(" ".join(paragraph))
    return "\n".join(text) + "\nThe next morning,"


def _estimate(text: str) -> int:
    """Tokens of ``text`` by the rule prompt_text relies on: a word or a punctuation mark each."""
    return len(re.findall(r"\w+|[^\w\s]", text))


# ----- HTTP -----


class Server:
    """A server root, an API key and the run's deadline; one request at a time.

    Every socket operation gets only the time the deadline leaves
    (patchkit.canary.transport), and every answer is decoded under MAX_BODY
    while it is read (patchkit.canary.decoding). No retries and no redirects: a
    probe must be fast and say what it saw. The key goes only into the
    Authorization header and is scrubbed from everything the canary prints.
    """

    def __init__(self, root: str, api_key: str | None, deadline: Deadline, record: Path | None):
        self.root, self.key, self.deadline, self.record = root, api_key, deadline, record
        self.url = httpx.URL(root)
        self.headers = request_headers(self.url, api_key)
        self.pool = transport.pool(deadline, CONNECT_TIMEOUT, httpx.create_ssl_context())
        self.exchanges = 0

    def close(self) -> None:
        self.pool.close()

    def now(self) -> float:
        return self.deadline.clock()

    def remaining(self) -> float:
        return self.deadline.remaining()

    def scrub(self, text: str) -> str:
        return scrub(text, self.key)

    def get(self, path: str) -> Exchange:
        return self.send("GET", path, None)

    def post(self, path: str, body: dict) -> Exchange:
        return self.send("POST", path, body)

    def send(self, method: str, path: str, body: dict | None) -> Exchange:
        if self.remaining() <= 0:
            raise Unanswered("the time budget (--timeout) ran out before this request")
        started = self.now()
        try:
            status, raw = self.exchange(method, path, body)
        except httpcore.ConnectTimeout:
            raise Unanswered(
                f"cannot connect within {self.now() - started:.0f} s (no answer to the "
                "connection attempt: a wrong address, or a firewall dropping packets)"
            ) from None
        except httpcore.TimeoutException:
            raise Unanswered(
                f"{method} {path} got no answer within {self.now() - started:.0f} s"
            ) from None
        except httpcore.ConnectError as exc:
            raise Unanswered(f"cannot connect ({self.scrub(_reason(exc))})") from None
        except TooLarge:
            raise Unreadable(
                f"{method} {path}: answer larger than {MAX_BODY} bytes (decoded)"
            ) from None
        except DecodeError as exc:
            raise Unreadable(f"{method} {path}: {self.scrub(_reason(exc))}") from None
        except HTTP_FAILURES as exc:
            raise Unanswered(f"{method} {path} failed: {self.scrub(_reason(exc))}") from None
        text = raw.decode("utf-8", errors="replace")
        exchange = Exchange(method, path, body, status, text, self.now() - started)
        self._save(exchange)
        return exchange

    def exchange(self, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
        """The status and the decoded body; the deadline is checked between every piece."""
        headers = list(self.headers)
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers.append((b"Content-Type", b"application/json"))
        target = httpcore.URL(
            scheme=self.url.raw_scheme,
            host=self.url.raw_host,
            port=self.url.port,
            target=self.url.raw_path.rstrip(b"/") + path.encode("ascii"),
        )
        with self.pool.stream(method.encode(), target, headers=headers, content=content) as answer:
            codings = [v.decode("latin-1") for k, v in answer.headers if k.lower() == ENCODING]
            decoded = CappedBody(codings, MAX_BODY, self.check_deadline)
            for chunk in answer.iter_stream():
                decoded.feed(chunk)
            return answer.status, decoded.finish()

    def check_deadline(self) -> None:
        self.deadline.left(httpcore.ReadTimeout)

    def _save(self, exchange: Exchange) -> None:
        """With --record: one JSON file per exchange (no headers, so no key)."""
        if self.record is None:
            return
        self.exchanges += 1
        slug = exchange.path.strip("/").replace("/", "_")
        name = f"{self.exchanges:03d}-{exchange.method}-{slug}"
        data = asdict(exchange)
        data["body"] = self.scrub(data["body"])
        # A new file renamed over the name: a symlink planted under that name in a
        # shared --record DIR is replaced, never written through (write_text follows it).
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.record)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, self.record / f"{name}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


ENCODING = b"content-encoding"
# What else httpcore raises: a malformed answer, a reset connection, an odd scheme.
HTTP_FAILURES = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpcore.ProxyError,
    httpcore.ConnectionNotAvailable,
)


def request_headers(url: httpx.URL, api_key: str | None) -> list[tuple[bytes, bytes]]:
    """Host (with an IPv6 address's brackets), the codings the canary decodes, and the key.

    A user:password@ in the URL is sent as Basic authentication instead of the
    key, as httpx did.
    """
    headers = [
        (b"Host", url.netloc),
        (b"Accept", b"application/json, text/plain, */*"),
        (b"Accept-Encoding", ACCEPTED.encode()),
        (b"User-Agent", b"patchkit-canary"),
    ]
    if url.username or url.password:
        pair = f"{url.username}:{url.password}".encode()
        headers.append((b"Authorization", b"Basic " + base64.b64encode(pair)))
    elif api_key:
        headers.append((b"Authorization", f"Bearer {api_key}".encode()))
    return headers


def _reason(exc: Exception) -> str:
    """The innermost cause's text: 'Connection refused', not a wrapper's; one short line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    return fields.one_line(re.sub(r"^\[Errno -?\d+\] ", "", text))


def normalize_url(url: str) -> str:
    """The server root: no trailing slash, no trailing /v1, no credentials kept for display."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def display_url(root: str) -> str:
    """The root without user:password@, for every line the canary prints (cut if long)."""
    parsed = httpx.URL(root)
    shown = str(parsed.copy_with(username=None, password=None)) if parsed.userinfo else root
    return fields.one_line(shown, 100)


def error_message(exchange: Exchange, api_key: str | None) -> str:
    """The message of a vLLM error body (`{"error": {"message"}}` or `{"error": "..."}`),
    the key scrubbed before it is cut (a cut key would escape the scrub), one short line."""
    data = exchange.json()
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str):
            return fields.one_line(scrub(error[: fields.SERVER_TEXT * 4], api_key))
    body = exchange.body.lstrip()[: fields.SERVER_TEXT * 4]
    first = body.splitlines()[0] if body.strip() else ""
    return fields.one_line(scrub(first, api_key))


# ----- discovery and metrics -----


def failure(message: str) -> PatchkitError:
    """A one-line error of at most fields.LINE characters (its server text already escaped)."""
    return PatchkitError(fields.one_line(message, fields.LINE))


def list_models(server: Server) -> list[dict]:
    """The model cards of `GET /v1/models`, each with the types the canary relies on;
    a PatchkitError (one line) when the server cannot say or says it wrongly."""
    where = display_url(server.root)
    try:
        answer = server.get("/v1/models")
    except Unreadable as exc:
        raise failure(f"{where} is not an OpenAI-compatible vLLM server: {exc}") from None
    except Unanswered as exc:
        raise failure(
            f"cannot reach the vLLM server at {where}: {exc}; is it running, and are the "
            "host and port right?"
        ) from None
    if answer.status == 401:
        raise failure(
            f"{where} answered 401 Unauthorized on /v1/models: pass the server's API key "
            "with --api-key or VLLM_API_KEY"
        )
    data = answer.json()
    if answer.status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        detail = error_message(answer, server.key) or "no model list"
        raise failure(
            f"{where} is not an OpenAI-compatible vLLM server: GET /v1/models answered "
            f"HTTP {answer.status} ({detail})"
        )
    try:
        return model_cards(data["data"])
    except WrongShape as exc:
        raise failure(
            f"{where} answered GET /v1/models with a model list the canary cannot read: "
            f"{fields.one_line(server.scrub(str(exc)))}"
        ) from None


def model_cards(data: list) -> list[dict]:
    """The cards, first of each id; WrongShape names the first field of the wrong type."""
    by_id: dict[str, dict] = {}
    for index, card in enumerate(data):
        where = f"data[{index}]"
        fields.obj(card, where)
        fields.text(card.get("id"), f"{where}.id")
        fields.text(card.get("parent"), f"{where}.parent", optional=True)
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


class Reading(NamedTuple):
    """What one read of the counter gave: a finite value, or None and why (unreadable:
    the counter is there but is no count, which could hide a rise)."""

    value: float | None
    why: str = ""
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
        return Reading(None, f"/metrics not read: {exc}")
    if answer.status != 200:
        return Reading(None, f"/metrics answered HTTP {answer.status}")
    lines = [line for line in answer.body.splitlines() if line.startswith(COUNTER_LINES)]
    if len(lines) > MAX_COUNTER_LINES:
        why = f"{COUNTER} has more than {MAX_COUNTER_LINES} lines on /metrics: unreadable"
        return Reading(None, why, unreadable=True)
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser raises ValueError and others on bad text
        why = f"{COUNTER} on /metrics is not Prometheus text ({type(exc).__name__}: {exc})"
        return Reading(None, fields.one_line(why), unreadable=True)
    samples = [s for f in families for s in f.samples if s.name in COUNTER_SAMPLES]
    if not samples:
        return Reading(None, COUNTER_ABSENT)
    odd = [s.value for s in samples if not math.isfinite(s.value)]
    if odd:
        why = (
            f"{COUNTER} on /metrics is {odd[0]}, not a count: unreadable, so a rise in it "
            "cannot be seen"
        )
        return Reading(None, why, unreadable=True)
    return Reading(sum(s.value for s in samples))


# ----- judging one model -----


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
    verdict = ModelCheck(model=card["id"], parent=card.get("parent"))
    started = server.now()
    try:
        answer = server.post("/v1/completions", request_body(card["id"], prompt, True))
        verdict.http_status = answer.status
        if answer.status == 200:
            judge_completion(verdict, answer, with_logprobs=True)
        else:
            message = error_message(answer, server.key)
            if NAN_MESSAGE.search(message):
                verdict.mark("bad", f"HTTP {answer.status}: '{message}' (NaN log-probabilities)")
            else:
                verdict.mark("error", f"HTTP {answer.status}: '{message}'")
            if answer.status != 404:
                look_at_text(server, verdict, card["id"], prompt)
    except Unanswered as exc:
        verdict.mark("error", str(exc))
    verdict.seconds = round(server.now() - started, 2)
    return verdict


def look_at_text(server: Server, verdict: ModelCheck, model: str, prompt: str) -> None:
    """The request again without log-probabilities: no NaN can break its JSON; the text shows."""
    answer = server.post("/v1/completions", request_body(model, prompt, False))
    if answer.status == 200:
        judge_completion(verdict, answer, with_logprobs=False)
    else:
        message = error_message(answer, server.key)
        verdict.evidence.append(f"without logprobs too: HTTP {answer.status}: '{message}'")


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
        verdict.mark("error", f"HTTP {answer.status} but {fields.one_line(str(exc))}")
        return
    verdict.text = completion.text
    verdict.token_ids = completion.token_ids
    if completion.prompt_tokens is not None:
        verdict.prompt_tokens = completion.prompt_tokens
    if completion.completion_tokens is not None:
        verdict.completion_tokens = completion.completion_tokens
    run = longest_zero_run(verdict.token_ids or [])
    if run >= ZERO_RUN_PROSE:
        verdict.mark("bad", f"{run} tokens of id 0 in a row ('!' in Qwen tokenizers)")
    elif verdict.token_ids is None and BANG_RUN in verdict.text:
        verdict.mark("bad", f"the text is a run of '!': {fields.one_line(verdict.text, 40)!r}")
    if with_logprobs:
        verdict.logprobs = completion.logprobs
        judge_logprobs(verdict, completion.logprobs)


def judge_logprobs(verdict: ModelCheck, values: list[float | None] | None) -> None:
    """Bad: none, null entries, NaN, infinite, positive (a log-probability is at most 0)
    or far below what a greedy token can have."""
    if not values:
        verdict.mark("bad", "no log-probabilities in the answer (logprobs were asked for)")
        return
    numbers = [v for v in values if v is not None]
    missing = len(values) - len(numbers)
    nan = sum(1 for v in numbers if math.isnan(v))
    infinite = sum(1 for v in numbers if math.isinf(v))
    positive = [v for v in numbers if math.isfinite(v) and v > 0]
    floor = [v for v in numbers if math.isfinite(v) and v < MIN_GREEDY_LOGPROB]
    if nan:
        verdict.mark("bad", f"{nan} of {len(values)} log-probabilities are NaN")
    if infinite:
        verdict.mark(
            "bad",
            f"{infinite} of {len(values)} log-probabilities are infinite (vLLM writes -inf "
            "as -9999.0, and none is ever +inf)",
        )
    if positive:
        verdict.mark(
            "bad",
            f"{len(positive)} of {len(values)} log-probabilities are positive (largest "
            f"{max(positive):.6g}; a log-probability is never above 0)",
        )
    if missing:
        verdict.mark("bad", f"{missing} of {len(values)} log-probabilities missing (null)")
    if floor:
        verdict.mark(
            "bad",
            f"greedy token with log-probability {min(floor)} (a sane argmax is above "
            f"{MIN_GREEDY_LOGPROB:.0f}; vLLM writes -inf as -9999.0)",
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


# ----- the run -----


def fitting_prompt(card: dict, by_id: dict[str, dict], wanted: int) -> tuple[int, str | None]:
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
    return fitted, f"prompt shortened to about {fitted} tokens to fit max_model_len {limit}"


def some_names(names: list[str], shown: int = 3) -> str:
    """The first few names, each cut short, and how many more: a bounded list for one line."""
    listed = ", ".join(fields.one_line(n, 40) for n in names[:shown]) or "nothing"
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def select(cards: list[dict], wanted: tuple[str, ...]) -> tuple[list[dict], list[ModelCheck]]:
    """The cards to check (all, base models first) and a not-served verdict per unknown --model."""
    if not wanted:
        return sorted(cards, key=lambda c: bool(c.get("parent"))), []
    by_id = {c["id"]: c for c in cards}
    served = some_names(list(by_id), shown=5)
    missing = [
        ModelCheck(
            model=name,
            verdict="not-served",
            evidence=[f"not in GET /v1/models (served: {served})"],
        )
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
                f"{len(report.skipped)} more models not checked (at most {MAX_MODELS} a run; "
                f"name them with --model): {some_names(report.skipped)}"
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
            report.notes.append("the server lists no models")
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
            evidence=["the time budget (--timeout) ran out before this model"],
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
            verdict.mark("error", reading.why)
        else:
            verdict.evidence.append(reading.why)
        return
    report.counter["after"] = reading.value
    verdict.corrupted_delta = reading.value - before
    if reading.value > before:
        verdict.mark(
            "bad",
            f"{COUNTER} rose by {reading.value - before:g} while its requests ran "
            "(other traffic on the server counts too)",
        )


def recheck_base(server: Server, report: Report, by_id: dict, tokens: int) -> None:
    """After a bad adapter, ask a sane base model again: confined, or is the server polluted?"""
    base = next((v for v in report.models if v.kind == "base" and v.verdict == "ok"), None)
    bad_adapter = any(v.kind == "adapter" and v.verdict == "bad" for v in report.models)
    if base is None or not bad_adapter or server.remaining() <= 0:
        return
    report.recheck = check_one(server, report, by_id[base.model], by_id, tokens)


# ----- output -----


def next_steps(report: Report) -> list[str]:
    """What the on-call engineer does next, given what went wrong."""
    if report.ok:
        return []
    bad = [v for v in report.models if v.verdict == "bad"]
    bad_base = [v for v in bad if v.kind == "base"]
    bad_adapters = [v.model for v in bad if v.kind == "adapter"]
    steps = []
    if bad_adapters and not bad_base:
        names = ", ".join(bad_adapters)
        steps += [
            f"the NaN comes through the LoRA path of {names} (the base model is sane): run "
            "`patchkit doctor` in the serving image (the Python that runs vLLM); it says "
            "whether vLLM #48590 (Hopper LoRA kernel) is exposed",
            "if exposed: `patchkit apply --clear-caches`, then restart the server",
            f"if protected: the weights of {names} themselves hold inf/NaN (patchkit's torch "
            "LoRA path keeps such an adapter's NaN in its own requests); replace the adapter, "
            "and stop routing to it meanwhile (POST /v1/unload_lora_adapter when the server "
            "allows runtime LoRA updates)",
        ]
    if bad_base:
        steps += [
            "the base model itself answers NaN, so LoRA is not the only cause: run "
            "`patchkit doctor` in the serving image and `patchkit apply --clear-caches`",
        ]
    steps += effect.next_steps([v for v in report.models if v.verdict == effect.NO_EFFECT])
    if report.recheck and report.recheck.verdict != "ok":
        steps.append("the base model went bad after the adapter: the server's state is polluted")
    if bad:
        steps.append(
            "restart the server: once a NaN has appeared, later requests can stay bad until a "
            "restart"
        )
    if any(v.verdict in ("error", "not-checked") for v in report.models):
        steps.append("look at the server's log for the failed requests; check --timeout")
    if any(v.verdict == "not-served" for v in report.models):
        steps.append("check the --model names against GET /v1/models (listed in the evidence)")
    if COUNTER_ABSENT in report.notes:
        steps.append(
            "start the server with VLLM_COMPUTE_NANS_IN_LOGITS=1 so the next NaN is also "
            f"counted in {COUNTER}"
        )
    return steps


def scrub(text: str, api_key: str | None) -> str:
    """The text with the API key replaced, for every line and JSON document printed."""
    return text.replace(api_key, "***") if api_key else text
