"""What the canary tests' fake vLLM server answers with (shared by the canary tests)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
