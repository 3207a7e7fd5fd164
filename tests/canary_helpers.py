"""The canary tests' stand-ins for vLLM's server: FakeVLLM (answers made like 0.26.0's, each
model behaving as told) and ReplayServer (a real server's recorded answers), and what
they answer with; shared by the canary tests and the JSON contract's."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from patchkit.canary import prompt

BASE = "Qwen/Qwen3.5-tiny"


def completion(body: dict, ids: list[int], logprob: float, text: str | None = None) -> dict:
    """A CompletionResponse as vLLM 0.26.0 writes it, honouring the request's options."""
    ids = ids[: body.get("max_tokens", 16)]
    text = " the keeper" * (len(ids) // 2) if text is None else text[: len(ids)]
    as_ids = body.get("return_tokens_as_token_ids")
    tokens = [f"token_id:{i}" if as_ids else ("!" if i == 0 else "x") for i in ids]
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = {
            "text_offset": list(range(len(ids))),
            "token_logprobs": [logprob] * len(ids),
            "tokens": tokens,
            "top_logprobs": [{t: logprob} for t in tokens],
        }
    prompt_tokens = prompt.estimate(body["prompt"])
    return {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def words(messages: list[dict]) -> list[str]:
    """The words of the canary's JSON messages (``{"code", "message", ...}``)."""
    return [m["message"] for m in messages]


class StandIn:
    """An HTTP server in a thread, started by ``with``: each request goes to
    ``serve(method, path, body, headers, write)``, which answers through
    ``write(status, payload, content_type)`` (a payload that is not bytes is sent as JSON)."""

    def __init__(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.httpd.daemon_threads = True
        # shutdown() waits for serve_forever's next poll: 0.5 s a test by default
        serve = lambda: self.httpd.serve_forever(poll_interval=0.01)  # noqa: E731
        self.thread = threading.Thread(target=serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def serve(self, method: str, path: str, body, headers: dict, write) -> None:
        raise NotImplementedError

    def handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers, then body: no 40 ms delayed-ACK wait each

            def log_message(self, *args):
                pass

            def do_GET(self):
                stand_in.serve("GET", self.path, None, dict(self.headers), self.write)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                stand_in.serve("POST", self.path, body, dict(self.headers), self.write)

            def write(self, status: int, payload, kind: str = "application/json") -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.close()


class ReplayServer(StandIn):
    """Answers each request with ``answer(method, path, request)`` (status, body bytes):
    recorded answers of a real vLLM server, replayed."""

    def answer(self, method: str, path: str, request) -> tuple[int, bytes]:
        raise NotImplementedError

    def serve(self, method, path, body, headers, write) -> None:
        write(*self.answer(method, path, body))


NAN_MESSAGE = "Out of range float values are not JSON compliant: nan"
SANE_IDS = [785, 1790, 6556, 11, 279, 1156, 572, 2087, 916, 279] * 4


class FakeVLLM(StandIn):
    """A server that answers like vLLM; each model behaves as told.

    Behaviours: ok, bang (200, token id 0 / '!' and finite log-probs),
    nan400 / nan500 (the NaN JSON error; 200 with '!!!' when asked without
    logprobs), plain500 (0.17: a text 500; then '!!!' without logprobs),
    plain500-sane (the same, then a sane text), nanlogprobs (a NaN literal in
    token_logprobs), nulllogprobs (logprobs: null), nullentries (null entries
    in token_logprobs), corrupt (sane answer, the
    corrupted-requests counter rises), hang (no answer until shut down),
    leaky (a 500 whose message quotes the Authorization header), bang-no-ids
    (a run of '!' from a server that ignores the token-id options), floor
    (log-probability -9999.0, vLLM's floor for -inf), polluted (sane until an
    adapter was bad, then '!!!'). A sane answer's log-probabilities differ per
    model (an adapter changes its base's answer), except inert (exactly the
    first model's answer: an adapter that changes nothing) and
    inert-other-token (the same log-probabilities, one token id other).
    """

    def __init__(self, models: dict[str, str], metrics: str = "counter", api_key=None, **kw):
        self.models = models  # id -> behaviour; the first is the base model
        self.metrics = metrics  # counter, untyped (no _total), absent, two-engines
        self.api_key = api_key
        self.max_model_len = kw.get("max_model_len", 8192)
        self.roots = kw.get("roots", {})  # id -> the card's root, else /models/<id>
        self.requests: list[dict] = []
        self.corrupted = 0
        self.polluted = False
        self.release = threading.Event()
        self.lock = threading.Lock()
        super().__init__()

    def completions(self) -> list[dict]:
        return [r for r in self.requests if r["path"] == "/v1/completions"]

    def serve(self, method, path, body, headers, write) -> None:
        record = {"path": path, "headers": headers, "body": body, "start": time.monotonic()}
        self.requests.append(record)
        answer = self.route(path, body, headers)
        # "end" is set before the answer goes out: the client can read the record as
        # soon as it has the answer, and its next request can only start after that
        record["end"] = time.monotonic()
        write(*answer)

    def __exit__(self, *exc):
        self.release.set()
        self.close()

    # ----- routes -----

    def route(self, path: str, body, headers: dict):
        if path.startswith("/v1") and self.api_key:
            if headers.get("Authorization") != f"Bearer {self.api_key}":
                return 401, {"error": "Unauthorized"}, "application/json"
        if path == "/v1/models":
            return 200, self.model_list(), "application/json"
        if path == "/version":
            return 200, {"version": "0.26.0"}, "application/json"
        if path == "/metrics":
            if self.metrics == "absent":
                return 200, generate_latest(self.registry(with_counter=False)), "text/plain"
            return 200, self.exposition(), "text/plain; version=0.0.4"
        if path == "/v1/completions":
            return self.completion(body, headers)
        return 404, {"detail": "Not Found"}, "application/json"

    def model_list(self) -> dict:
        now = int(time.time())
        names = list(self.models)

        def card(name, parent, max_len):
            return {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": self.roots.get(name, f"/models/{name}"),
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{name}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        cards = [card(names[0], None, self.max_model_len)]
        cards += [card(name, names[0], None) for name in names[1:]]
        return {"object": "list", "data": cards}

    def registry(self, with_counter=True) -> CollectorRegistry:
        registry = CollectorRegistry()
        Gauge("vllm:num_requests_running", "Running", ["model_name", "engine"], registry=registry)
        other = Counter(
            "vllm:prompt_tokens", "Prompt tokens", ["model_name", "engine"], registry=registry
        )
        other.labels(BASE, "0").inc(12345)  # a counter that is not the one the canary reads
        if with_counter:
            counter = Counter(
                "vllm:corrupted_requests",
                "Corrupted requests, in terms of total number of requests with NaNs in logits.",
                ["model_name", "engine"],
                registry=registry,
            )
            engines = ("0", "1") if self.metrics == "two-engines" else ("0",)
            for engine in engines:
                counter.labels(BASE, engine).inc(self.corrupted)
        return registry

    def exposition(self) -> bytes:
        nan = self.metrics == "nan" or (self.metrics == "nan-later" and self.completions())
        if nan:  # an exporter (or a proxy) writing NaN for the counter
            return (
                "# TYPE vllm:corrupted_requests_total counter\n"
                f'vllm:corrupted_requests_total{{engine="0",model_name="{BASE}"}} NaN\n'
            ).encode()
        if self.metrics == "untyped":  # an exporter that writes the counter without _total
            return (
                "# HELP vllm:corrupted_requests Corrupted requests.\n"
                "# TYPE vllm:corrupted_requests untyped\n"
                f'vllm:corrupted_requests{{engine="0",model_name="{BASE}"}} {self.corrupted}\n'
            ).encode()
        return generate_latest(self.registry())

    def completion(self, body: dict, headers: dict):
        model = body.get("model")
        behaviour = self.models.get(model)
        if behaviour is None:
            return 404, error(f"The model `{model}` does not exist.", "NotFoundError", 404), JSON
        logprobs = body.get("logprobs") is not None
        if behaviour == "hang":
            self.release.wait(30)
            return 200, completion(body, SANE_IDS, -0.5), JSON
        if behaviour in ("nan400", "nan500") and logprobs:
            code = 400 if behaviour == "nan400" else 500
            return code, error(NAN_MESSAGE, "BadRequestError", code), JSON
        if behaviour.startswith("plain500") and logprobs:
            return 500, b"Internal Server Error", "text/plain; charset=utf-8"
        if behaviour == "leaky":
            message = f"engine failed for {headers.get('Authorization')}"
            return 500, error(message, "InternalServerError", 500), JSON
        if behaviour == "polluted" and self.polluted:  # sane until a bad request ran
            return 200, completion(body, [0] * 32, -0.01, text="!" * 32), JSON
        if behaviour in ("bang", "nan400") and model != list(self.models)[0]:
            self.polluted = True
        if behaviour == "bang-no-ids":  # a server that ignores the token-id options
            plain = {k: v for k, v in body.items() if not k.startswith("return_")}
            return 200, completion(plain, [0] * 32, -0.01, text="!" * 32), JSON
        if behaviour == "floor":
            return 200, completion(body, SANE_IDS, -9999.0), JSON
        if behaviour == "corrupt":
            with self.lock:
                self.corrupted += 1
        if behaviour in ("bang", "nan400", "nan500", "plain500"):
            return 200, completion(body, [0] * 32, -0.01, text="!" * 32), JSON
        if behaviour == "nanlogprobs":
            return 200, completion(body, SANE_IDS, float("nan")), JSON
        if behaviour in BAD_LOGPROBS:  # written as JSON's Infinity literals, as Python does
            answer = completion(body, SANE_IDS, -0.5)
            answer["choices"][0]["logprobs"]["token_logprobs"][:3] = BAD_LOGPROBS[behaviour]
            return 200, answer, JSON
        ids = SANE_IDS[:5] + [7] + SANE_IDS[6:] if behaviour == "inert-other-token" else SANE_IDS
        answer = completion(body, ids, self.sane_logprob(model))
        if behaviour == "nulllogprobs":
            answer["choices"][0]["logprobs"] = None
        if behaviour == "nullentries":  # vLLM writes None where a step has no logprobs
            answer["choices"][0]["logprobs"]["token_logprobs"][3:] = [None] * 29
        return 200, answer, JSON

    def sane_logprob(self, model: str) -> float:
        """Each model its own log-probability (an adapter changes its base's answer), but
        `inert` answers exactly as the first model (the base) does."""
        if self.models[model].startswith("inert"):
            return -0.5
        return -0.5 - 0.25 * list(self.models).index(model)


JSON = "application/json"
BAD_LOGPROBS = {
    "inf-positive": [float("inf"), 5.0, -0.1],
    "minus-inf": [float("-inf"), -0.1, -0.1],
    "positive": [0.5, 1e-3, -0.1],
}


def error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
