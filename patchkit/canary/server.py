"""The canary's HTTP: one request at a time to one server, bounded by one deadline.

Why httpx's transport, httpcore: one small dependency, the raw status and
body of every answer, and a pluggable network backend, so each socket
operation gets only the time the run's deadline leaves (patchkit.canary.
transport; a timeout per request is no bound on a server that trickles).
The body comes undecoded and is decoded under a cap (patchkit.canary.
decoding). The official openai client is larger, retries on its own, and
turns a 500's body into an exception that hides it.

An API key (`--api-key` / `VLLM_API_KEY` on the server) guards `/v1/*`; a
wrong one gets 401 `{"error": "Unauthorized"}` (vLLM 0.26.0
server_utils.py:91). The key goes only into the Authorization header and is
scrubbed from everything the canary prints or records.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import httpcore
import httpx

from patchkit.canary import fields, transport
from patchkit.canary.decoding import ACCEPTED, CappedBody, DecodeError, TooLarge
from patchkit.canary.transport import Deadline

CONNECT_TIMEOUT = 5.0  # a refused or unroutable address fails fast, not at the deadline

MAX_BODY = 16 * 1024 * 1024  # decoded bytes of one answer: a wrong URL must not fill memory


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


def scrub(text: str, api_key: str | None) -> str:
    """The text with the API key replaced, for every line and JSON document printed."""
    return text.replace(api_key, "***") if api_key else text
