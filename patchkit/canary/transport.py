"""HTTP for the canary under one deadline that no read, write, lookup or retry can extend.

A timeout per request is not a bound on the run: a server that sends one
byte just before a read timeout, then another, keeps a request alive for
ever, and a read that starts a second before the deadline with the request's
whole timeout ends long after it. So every network operation asks the
`Deadline` for the time left and gets no more: the name lookup, the connect,
the TLS handshake, each write and each read. The deadline's clock is
injectable, so tests drive it instead of waiting.

httpcore (httpx's own transport, installed with it) does the HTTP/1.1; its
network backend is the documented place to plug the sockets in. It never
decodes a Content-Encoding and never follows a redirect or retries a
request, so what comes back is the server's raw answer, decoded by
`patchkit.canary.decoding` under a byte cap.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpcore


class Deadline:
    """The end of the run, on a monotonic clock that tests may replace."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def remaining(self) -> float:
        return self.end - self.clock()

    def within(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, or this one if that comes first (the connect's)."""
        sooner = Deadline(seconds, self.clock)
        sooner.end = min(sooner.end, self.end)
        return sooner

    def left(self, expired: type[Exception]) -> float:
        """The seconds the next operation may take; ``expired`` when none are left."""
        seconds = self.remaining()
        if seconds <= 0:
            raise expired("the deadline passed")
        return seconds


@contextlib.contextmanager
def _mapped(timeout: type[Exception], failure: type[Exception]) -> Iterator[None]:
    """Socket errors as httpcore's, so its connection pool cleans up as it expects."""
    try:
        yield
    except TimeoutError as exc:  # socket.timeout is TimeoutError
        raise timeout(str(exc) or "timed out") from exc
    except OSError as exc:
        raise failure(str(exc) or type(exc).__name__) from exc


class BoundedStream(httpcore.NetworkStream):
    """A socket whose every read and write gets only the time the deadline leaves."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        self.sock, self.deadline = sock, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _mapped(httpcore.ReadTimeout, httpcore.ReadError):
            self.sock.settimeout(self.deadline.left(httpcore.ReadTimeout))
            return self.sock.recv(max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """send() per piece, each with the time left (sendall would restart it per call)."""
        view = memoryview(buffer)
        with _mapped(httpcore.WriteTimeout, httpcore.WriteError):
            while view:
                self.sock.settimeout(self.deadline.left(httpcore.WriteTimeout))
                view = view[self.sock.send(view) :]

    def close(self) -> None:
        self.sock.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> BoundedStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            self.sock.settimeout(self.deadline.left(httpcore.ConnectTimeout))
            try:
                wrapped = ssl_context.wrap_socket(self.sock, server_hostname=server_hostname)
            except BaseException:
                self.sock.close()
                raise
        return BoundedStream(wrapped, self.deadline)

    def get_extra_info(self, info: str):
        if info == "ssl_object":
            return getattr(self.sock, "_sslobj", None)
        if info == "client_addr":
            return self.sock.getsockname()
        if info == "server_addr":
            return self.sock.getpeername()
        if info == "socket":
            return self.sock
        if info == "is_readable":  # a kept-alive connection the server closed reads EOF
            return self.sock.fileno() < 0 or bool(select.select([self.sock], [], [], 0)[0])
        return None


class BoundedBackend(httpcore.NetworkBackend):
    """Connections whose lookup and connect end by the sooner of the deadline and connect_s."""

    def __init__(self, deadline: Deadline, connect_s: float):
        self.deadline, self.connect_s = deadline, connect_s

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        until = self.deadline.within(self.connect_s)
        addresses = resolve(host, port, until)
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
                    sock.settimeout(until.left(httpcore.ConnectTimeout))
                    sock.connect(address)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return BoundedStream(sock, self.deadline)
            except (httpcore.ConnectTimeout, httpcore.ConnectError) as exc:
                sock.close()
                failure = exc
        raise failure

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.UnsupportedProtocol("unix sockets are not used by the canary")

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline.remaining())))


def resolve(host: str, port: int, until: Deadline) -> list:
    """getaddrinfo with a time limit: it has none of its own, so it runs in a daemon thread
    that is left behind (to end with the process) when the name server does not answer."""
    found: dict = {}

    def lookup() -> None:
        try:
            found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            found["error"] = exc

    thread = threading.Thread(target=lookup, name="canary-lookup", daemon=True)
    thread.start()
    thread.join(until.left(httpcore.ConnectTimeout))
    if "addresses" in found:
        return found["addresses"]
    if "error" in found:
        raise httpcore.ConnectError(str(found["error"]))
    raise httpcore.ConnectTimeout(f"no address for {host} in time (the name lookup hangs)")


def pool(deadline: Deadline, connect_s: float, ssl_context) -> httpcore.ConnectionPool:
    """One connection at a time, no retries, every socket bounded by ``deadline``."""
    return httpcore.ConnectionPool(
        ssl_context=ssl_context,
        max_connections=1,
        retries=0,
        network_backend=BoundedBackend(deadline, connect_s),
    )
