"""`patchkit canary` against hostile servers: bounded in time, memory and output, never exit 3.

The servers here write raw HTTP on 127.0.0.1 (a socket per connection, in a
thread), so they can do what no framework lets a handler do: stop after one
byte, trickle headers, stack Content-Encodings, nest JSON a hundred thousand
deep. Time is a `SkewClock`: the real monotonic clock plus jumps the server
makes ("the server took 9 s"), handed to `check.run`; the tests assert on
its readings, never on wall time. Memory is bounded with RLIMIT_AS in a
child process and with a byte counter on the decoder.
"""

from __future__ import annotations

import functools
import gzip
import json
import socket
import threading
import time
import zlib

import pytest

from patchkit.canary import check
from patchkit.errors import PatchkitError
from tests.canary_helpers import BASE, completion, words
from tests.conftest import run_cli, run_subprocess

LINE_LIMIT = 300


class SkewClock:
    """time.monotonic plus the seconds the test server says passed."""

    def __init__(self):
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew

    def jump(self, seconds: float) -> None:
        self.skew += seconds


def http(status: int, body: bytes, *headers: str, length: int | None = None) -> bytes:
    """One raw HTTP/1.1 answer; ``length`` overrides Content-Length (a promise not kept)."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode() + body


def as_json(data, status: int = 200) -> bytes:
    return http(status, json.dumps(data).encode(), "Content-Type: application/json")


def models(*names: str) -> bytes:
    cards = [{"id": names[0], "parent": None, "max_model_len": 8192}]
    cards += [{"id": n, "parent": names[0], "max_model_len": None} for n in names[1:]]
    return as_json({"object": "list", "data": cards})


METRICS = (
    "# HELP vllm:corrupted_requests_total Corrupted requests.\n"
    "# TYPE vllm:corrupted_requests_total counter\n"
    'vllm:corrupted_requests_total{{engine="0",model_name="m"}} {value}\n'
)


def healthy(path: str, request: dict | None) -> bytes:
    if path == "/v1/models":
        return models(BASE, "lora")
    if path == "/version":
        return as_json({"version": "0.26.0"})
    if path == "/metrics":
        return http(200, METRICS.format(value="0.0").encode(), "Content-Type: text/plain")
    logprob = -0.5 if request["model"] == BASE else -0.75  # an adapter changes the answer
    return as_json(completion(request, [785, 1790, 6556, 11] * 8, logprob))


class RawServer:
    """Answers each request with ``route(path, request, conn)``: bytes to send, or None when
    the route wrote (or withheld) the answer itself. Connections are kept alive."""

    def __init__(self, route):
        self.route, self.paths = route, []
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self.serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.connection, args=(conn,), daemon=True).start()

    def connection(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            try:
                while (request := self.read(conn)) is not None:
                    path, body = request
                    self.paths.append(path)
                    answer = self.route(path, body, conn)
                    if answer is None:
                        return
                    conn.sendall(answer)
            except OSError:
                return

    def read(self, conn: socket.socket):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            (
                int(v)
                for k, _, v in (h.partition(":") for h in lines[1:])
                if k.lower() == "content-length"
            ),
            0,
        )
        while len(body) < length:
            body += conn.recv(65536)
        return lines[0].split()[1], json.loads(body) if body else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.listener.close()


def routes(**special):
    """The healthy routes, with some replaced: special['v1_models'] answers /v1/models."""

    def route(path, request, conn):
        handler = special.get(path.strip("/").replace("/", "_"))
        if handler is None:
            return healthy(path, request)
        return handler(request, conn) if callable(handler) else handler

    return route


# ----- the deadline -----


def run_with_clock(url: str, timeout: float, clock: SkewClock, **kw):
    """check.run with the skew clock: the report, or the one-line error, and the clock's
    reading at the start and at the end."""
    start = clock()
    try:
        outcome = check.run(url, timeout=timeout, clock=clock, **kw)
    except PatchkitError as exc:
        outcome = exc
    return outcome, clock() - start


@pytest.mark.slow
def test_one_byte_just_before_the_deadline_then_silence_ends_at_the_deadline():
    """The read after that byte got the request's whole timeout again: --timeout 10 took 19 s."""
    clock = SkewClock()

    def late_byte(request, conn):
        conn.sendall(http(200, b"", "Content-Type: application/json", length=100))
        clock.jump(9)  # the server took 9 of the 10 seconds
        conn.sendall(b"{")
        server.stop.wait(30)  # then silence

    with RawServer(routes(v1_models=late_byte)) as server:
        outcome, elapsed = run_with_clock(server.url, 10, clock)
    assert isinstance(outcome, PatchkitError) and "got no answer within" in str(outcome)
    assert elapsed <= 10 + 1


def test_headers_trickled_a_byte_at_a_time_end_at_the_deadline():
    """No read was ever given the time left while the headers came in: a byte every
    half second kept one request alive for hours (h11 takes 16 kB of headers)."""
    clock = SkewClock()

    def slowloris(request, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        for _ in range(400):  # bounded: the old canary stops at the end of these
            clock.jump(0.5)
            conn.sendall(b"a")
            if server.stop.wait(0.005):
                break

    with RawServer(routes(v1_models=slowloris)) as server:
        outcome, elapsed = run_with_clock(server.url, 10, clock)
    assert isinstance(outcome, PatchkitError) and "got no answer within" in str(outcome)
    assert elapsed <= 10 + 1


def test_an_endless_chunked_body_ends_at_the_deadline():
    clock = SkewClock()

    def endless(request, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(400):
            clock.jump(0.5)
            conn.sendall(b"1\r\n \r\n")
            if server.stop.wait(0.005):
                break

    with RawServer(routes(v1_completions=endless)) as server:
        report, elapsed = run_with_clock(server.url, 10, clock)
    assert elapsed <= 10 + 1
    assert [m.verdict for m in report.models] == ["error", "not-checked"]
    assert "got no answer within" in report.models[0].evidence[0]["error"]


def test_second_looks_and_many_models_share_one_deadline():
    """Each failed completion is asked again without logprobs; all of it fits the budget."""
    clock = SkewClock()

    def slow_500(request, conn):
        clock.jump(0.9)
        return http(500, b"Internal Server Error", "Content-Type: text/plain")

    names = [BASE] + [f"lora-{i}" for i in range(20)]
    with RawServer(routes(v1_models=models(*names), v1_completions=slow_500)) as server:
        report, elapsed = run_with_clock(server.url, 5, clock)
    assert elapsed <= 5 + 1
    verdicts = [m.verdict for m in report.models]
    assert "not-checked" in verdicts and verdicts[0] == "error"


def test_redirects_are_answers_not_followed():
    """A redirect loop or a file:// redirect costs one request and is named."""
    loop = http(302, b"", "Location: /v1/models")
    with RawServer(routes(v1_models=loop)) as server:
        result = run_cli("canary", "--url", server.url, "--timeout", "5")
    assert result.exit_code == 1 and server.paths == ["/v1/models"]
    assert "GET /v1/models answered HTTP 302" in result.stderr


def test_a_name_lookup_that_hangs_is_cut_at_the_connect_deadline(monkeypatch):
    """getaddrinfo has no timeout of its own; the lookup runs in a thread given the time."""
    from patchkit.canary import transport

    release = threading.Event()
    calls = []

    def hanging_lookup(*args, **kw):
        calls.append(args)
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(transport.socket, "getaddrinfo", hanging_lookup)
    clock = SkewClock()
    deadline = transport.Deadline(10, clock)
    backend = transport.BoundedBackend(deadline, connect_s=0.2)
    try:
        with pytest.raises(transport.httpcore.ConnectTimeout, match="name lookup hangs"):
            backend.connect_tcp("vllm.internal", 8000)
    finally:
        release.set()
    assert calls == [("vllm.internal", 8000)]


# ----- decoding under a cap -----


@functools.lru_cache(maxsize=1)
def gzip_gzip_bomb() -> bytes:
    """512 MiB of zeros, gzip in gzip: about 1 kB on the wire (one member each, as a
    server writes it)."""
    inner = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    parts = [inner.compress(zeros) for _ in range(512)] + [inner.flush()]
    return gzip.compress(b"".join(parts), 9)


def counting_body(*args):
    """A CappedBody that records the largest piece that reached each stage: the byte
    counter of these tests (imported here: the module is new, and the CLI tests of this
    file run against any canary)."""
    from patchkit.canary import decoding

    class CountingBody(decoding.CappedBody):
        def _push(self, level: int, data: bytes) -> None:
            self.largest[level] = max(self.largest[level], len(data))
            super()._push(level, data)

    body = CountingBody(*args)
    body.largest = [0] * len(body.counts)
    return body


def encode(data: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "raw-deflate":
        packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
        return packer.compress(data) + packer.flush()
    return data


@pytest.mark.parametrize(
    "header", ["gzip", "deflate", "gzip, gzip", "deflate, gzip", "identity, gzip, deflate"]
)
def test_every_coding_stops_at_the_cap_while_decoding(header):
    """zlib is asked for PIECE bytes at a time: no stage ever holds more, and decoding stops
    as soon as a stage passes the cap (the old cap counted only after a whole chunk)."""
    data = bytes(64 << 20)
    for coding in (c.strip() for c in header.split(",")):
        data = encode(data, coding)
    from patchkit.canary import decoding

    body = counting_body([header], 1 << 20, lambda: None)
    with pytest.raises(decoding.TooLarge):
        for start in range(0, len(data), 65536):
            body.feed(data[start : start + 65536])
    assert max(body.largest[1:]) <= decoding.PIECE
    assert sum(len(p) for p in body.parts) <= 1 << 20


@pytest.mark.parametrize(
    "codings,header",
    [
        (["gzip"], "gzip"),
        (["gzip"], "x-gzip"),
        (["deflate"], "deflate"),
        (["raw-deflate"], "deflate"),
        (["gzip", "deflate"], "gzip, deflate"),
        (["identity", "gzip"], "identity,gzip"),
        ([], ""),
    ],
)
def test_decoding_gives_the_bytes_back(codings, header):
    from patchkit.canary import decoding

    data = json.dumps({"text": "the keeper " * 5000}).encode()
    wire = data
    for coding in codings:
        wire = encode(wire, coding)
    body = decoding.CappedBody([header] if header else [], 1 << 20, lambda: None)
    for start in range(0, len(wire), 100):
        body.feed(wire[start : start + 100])
    assert body.finish() == data


def test_gzip_members_follow_each_other_and_other_codings_are_refused():
    from patchkit.canary import decoding

    body = decoding.CappedBody(["gzip"], 1 << 20, lambda: None)
    body.feed(gzip.compress(b"one ") + gzip.compress(b"two"))
    assert body.finish() == b"one two"
    with pytest.raises(decoding.DecodeError, match="'br' is not supported"):
        decoding.CappedBody(["br"], 1 << 20, lambda: None)
    with pytest.raises(decoding.DecodeError, match="after the end of the deflate"):
        decoding.CappedBody(["deflate"], 1 << 20, lambda: None).feed(zlib.compress(b"x") + b"x")
    with pytest.raises(decoding.DecodeError, match="stacked"):
        decoding.CappedBody(["gzip, gzip, gzip, gzip, gzip"], 1 << 20, lambda: None)


@pytest.mark.slow
def test_a_stacked_gzip_bomb_stays_within_a_memory_limit():
    """`Content-Encoding: gzip, gzip`, about 1 kB: the old canary decoded it whole (4.2 GB
    for the reported 3,477 bytes). In a child limited to 256 MiB of address space the
    canary now says the answer is too large, exit 1."""
    bomb = gzip_gzip_bomb()
    answer = http(200, bomb, "Content-Type: application/json", "Content-Encoding: gzip, gzip")
    limit = 256 << 20
    prelude = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))"
    with RawServer(routes(v1_models=answer)) as server:
        result = run_subprocess("canary", "--url", server.url, "--timeout", "30", code=prelude)
    assert result.returncode == 1, result.stderr
    assert (
        "not an OpenAI-compatible vLLM server: GET /v1/models: answer larger than 16777216 bytes"
        in result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1


# ----- many models, long lines -----


@pytest.mark.slow
def test_at_most_64_models_are_checked_and_the_rest_named_in_one_line():
    """100,000 listed models took 13.7 s at --timeout 10 and printed a 7.8 MB error line."""
    names = [BASE] + [f"lora-{i:06d}" for i in range(100_000)]
    with RawServer(routes(v1_models=models(*names))) as server:
        result = run_cli("canary", "--url", server.url, "--timeout", "60", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.stderr
    assert len(report["models"]) == 64 and report["skipped"] == 100_001 - 64
    assert server.paths.count("/v1/completions") == 64
    note = next(n for n in words(report["notes"]) if "more models not checked" in n)
    assert note.startswith("99937 more models not checked (at most 64 a run")
    assert note.endswith("lora-000063, lora-000064, lora-000065 and 99934 more")
    assert len(note) <= LINE_LIMIT


def test_every_error_line_is_one_short_line_whatever_the_server_writes():
    """A 100 kB error message with newlines and ESC, a 10 kB model id."""
    long_id = "m" + "\x1b[2J\n" * 2000
    message = "boom\n" + "x" * 100_000

    def failing(request, conn):
        return as_json({"error": {"message": message, "code": 500}}, status=500)

    with RawServer(routes(v1_models=models(long_id, "b"), v1_completions=failing)) as server:
        text = run_cli("canary", "--url", server.url, "--timeout", "20")
        result = run_cli("canary", "--url", server.url, "--timeout", "20", "--json")
    report = json.loads(result.stdout)
    assert text.exit_code == result.exit_code == 1
    assert len(text.stderr.splitlines()) == 1 and len(text.stderr.rstrip("\n")) <= LINE_LIMIT
    assert "\x1b" not in text.stderr
    assert len(report["error"]["message"]) <= LINE_LIMIT - len("patchkit: error: ")
    for model in report["models"]:
        for evidence in words(model["evidence"]):
            assert len(evidence) <= LINE_LIMIT and "\n" not in evidence
    long_lines = [line for line in text.stdout.splitlines() if len(line) > LINE_LIMIT]
    assert not long_lines, [len(line) for line in long_lines]  # the per-model lines too
    assert "\x1b" not in text.stdout


# ----- hostile JSON -----

DEEP = ("[" * 100_000 + "]" * 100_000).encode()


def answer_with(**fields) -> callable:
    """A completion route whose answer has some fields replaced (a path: 'choices.0.text')."""

    def route(request, conn):
        data = completion(request, [785, 1790, 6556, 11] * 8, -0.5)
        for dotted, value in fields.items():
            *parents, last = dotted.split(".")
            target = data
            for key in parents:
                target = target[int(key)] if key.isdigit() else target[key]
            target[int(last) if last.isdigit() else last] = value
        return as_json(data)

    return route


@pytest.mark.parametrize(
    "special,says",
    [
        ({"v1_models": http(200, b'{"object": "list", "data": ' + DEEP + b"}")}, "not an OpenAI"),
        ({"v1_models": as_json({"data": [{"id": ["a", "b"]}]})}, "data[0].id is list, not a str"),
        ({"v1_models": as_json({"data": [{"id": 7}]})}, "data[0].id is int, not a string"),
        ({"v1_models": as_json({"data": [{"id": "a", "parent": []}]})}, "data[0].parent is"),
        ({"v1_models": as_json({"data": [{"id": "a", "max_model_len": "8k"}]})}, "max_model_len"),
        ({"v1_models": as_json({"data": [["a"]]})}, "data[0] is list, not an object"),
        ({"v1_completions": answer_with(usage=[1, 2])}, "usage is list, not an object"),
        ({"v1_completions": http(200, DEEP)}, "the answer is not JSON"),
        ({"v1_completions": answer_with(**{"usage.prompt_tokens": "12"})}, "prompt_tokens is str"),
        ({"v1_completions": answer_with(**{"usage.completion_tokens": True})}, "is bool"),
        ({"v1_completions": answer_with(choices={"0": 1})}, "choices is dict, not a list"),
        ({"v1_completions": answer_with(choices=[])}, "choices is empty"),
        ({"v1_completions": answer_with(**{"choices.0": "x"})}, "choices[0] is str"),
        ({"v1_completions": answer_with(**{"choices.0.text": ["!"]})}, "text is list"),
        ({"v1_completions": answer_with(**{"choices.0.token_ids": "0 0 0"})}, "token_ids is str"),
        ({"v1_completions": answer_with(**{"choices.0.token_ids.3": -1})}, "is negative"),
        ({"v1_completions": answer_with(**{"choices.0.logprobs": [1]})}, "logprobs is list"),
        (
            {"v1_completions": answer_with(**{"choices.0.logprobs.token_logprobs.2": "-0.1"})},
            "token_logprobs[2] is str, not a number",
        ),
        (
            {
                "v1_completions": answer_with(
                    **{"choices.0.token_ids": None, "choices.0.logprobs.tokens": 5}
                )
            },
            "logprobs.tokens is int",
        ),
    ],
)
def test_hostile_json_is_one_line_and_exit_1_never_a_traceback(special, says):
    with RawServer(routes(**special)) as server:
        result = run_cli("canary", "--url", server.url, "--timeout", "20")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert len(result.stderr.splitlines()) == 1 and len(result.stderr.rstrip("\n")) <= LINE_LIMIT
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize(
    "version", [http(200, DEEP), as_json({"version": ["0.26.0"]}), as_json([1])]
)
def test_a_hostile_version_answer_is_no_version(version):
    with RawServer(routes(version=version)) as server:
        result = run_cli("canary", "--url", server.url, "--timeout", "20", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["ok"] is True and report["vllm_version"] is None
