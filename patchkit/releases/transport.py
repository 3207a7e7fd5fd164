"""HTTP for fetch: index pages, byte ranges of a wheel, a whole wheel; bounded and checked.

The standard library's urllib, set up as pip sets up its session: proxies
from the environment (``http_proxy``, ``https_proxy``, ``no_proxy``) or pip's
``proxy`` setting, pip's ``cert`` as the CA bundle, credentials from the URL
itself, from the index URL of the same host, or from netrc (``$NETRC``, else
``~/.netrc``). Credentials go as an unredirected header: a redirect to
another host never carries them, one to the same host gets them again.

Every answer is hostile until checked: a body is read up to a limit and no
further, a range answer must carry the Content-Range asked for and exactly
that many bytes, redirects are few and stay on http(s) (never https to
http), and every failure is one line naming the host.
"""

from __future__ import annotations

import base64
import http.client
import netrc
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass

from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.releases.pipconfig import PipSettings

MAX_REDIRECTS = 5
CHUNK = 1 << 20
CONTENT_RANGE = re.compile(r"bytes (\d{1,15})-(\d{1,15})/(\d{1,15})")
DIGITS = re.compile(r"[0-9]{1,15}")  # ASCII: str.isdigit() takes '²', which int() refuses
DEADLINE = 1800.0  # seconds for one whole fetch; PATCHKIT_FETCH_DEADLINE changes it


class FetchError(PatchkitError):
    """A one-line failure of the index, the server or the wheel (``status``: the HTTP
    status where the server answered with an error; ``host`` where one failed)."""

    code = Code.FETCH_FAILED

    def __init__(self, message: str, status: int | None = None, **facts: object):
        answered = {"status": status} if status is not None else {}
        super().__init__(message, **answered, **facts)
        self.status = status


class WheelNotFound(FetchError):
    """No wheel of the ``version`` asked for at the places pip is configured with."""

    code = Code.WHEEL_NOT_FOUND


class WheelMismatch(FetchError):
    """The wheel (``wheel``: its file name) is not what its index says: another size or
    sha256, or it changed while it was read."""

    code = Code.WHEEL_MISMATCH


class DeadlineInvalid(PatchkitError):
    """PATCHKIT_FETCH_DEADLINE is no positive number of seconds: its ``value``."""

    code = Code.FETCH_DEADLINE_INVALID


class RangesRefused(Exception):
    """The server answered a range request with something else than the range (a 200,
    a 416, ``Accept-Ranges: none``); the caller downloads the whole file instead."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why
        self.response = None  # the 200 that refused, where the whole body can be read


@dataclass(frozen=True)
class Page:
    """An index page: the URL it ended at (links are relative to it), its type and body."""

    url: str
    content_type: str
    body: bytes


def host_of(url: str) -> str:
    """The host of a URL without its credentials, for messages."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or parts.path[:60] or "?"


def without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


class Transport:
    """One session: the opener, and the credentials each host gets."""

    def __init__(self, settings: PipSettings, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.timeout = settings.timeout
        self.deadline = Deadline(deadline_seconds(env))
        self.index_credentials = _index_credentials(settings.index_urls)
        self.netrc_path = env.get("NETRC") or os.path.join(
            env.get("HOME") or os.path.expanduser("~"), ".netrc"
        )
        proxies = (
            {"http": settings.proxy, "https": settings.proxy}
            if settings.proxy
            else urllib.request.getproxies_environment()
        )
        context = _tls(settings.cert)
        self.addresses = _Addresses()
        plain, secure = _connections(self.addresses, self.deadline)
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler(proxies),
            _PlainHandler(plain),
            _SecureHandler(secure, context),
            _Redirects(self),
        )
        # an opener has no FileHandler of ours: file: URLs are read by the caller
        self.requests = 0
        self.bytes_read = 0
        self._counting = threading.Lock()  # range reads run in a few threads

    # -- credentials ---------------------------------------------------------
    def credentials(self, url: str) -> tuple[str, str] | None:
        """(user, password) for ``url``: its own, its index's (same host and port), or netrc's."""
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None:
            return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
        own = self.index_credentials.get(_netloc(parts))
        if own:
            return own
        return self._netrc(parts.hostname or "")

    def _netrc(self, host: str) -> tuple[str, str] | None:
        try:
            entry = netrc.netrc(self.netrc_path).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            return None
        if not entry:
            return None
        login, _, password = entry
        return login or "", password or ""

    def authorize(self, request: urllib.request.Request, url: str) -> None:
        found = self.credentials(url)
        if found:
            token = base64.b64encode(f"{found[0]}:{found[1]}".encode()).decode()
            request.add_unredirected_header("Authorization", f"Basic {token}")

    # -- requests --------------------------------------------------------------
    def request(self, url: str, headers: dict[str, str] | None = None) -> urllib.request.Request:
        plain = without_credentials(url)
        scheme = urllib.parse.urlsplit(plain).scheme
        if scheme not in ("http", "https"):
            raise FetchError(f"fetch: {plain[:120]} is not an http(s) URL")
        request = urllib.request.Request(plain, headers={"User-Agent": "patchkit-fetch"})
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        self.authorize(request, url)
        return request

    def close(self) -> None:
        """The deadline's watch ends (the fetch is over)."""
        self.deadline.cancel()

    def open(self, url: str, headers: dict[str, str] | None = None):
        """The response to a GET (any 2xx); an HTTP error or a network failure is one line,
        the deadline's own once it has passed (it cut the connection)."""
        request = self.request(url, headers)
        with self._counting:
            self.requests += 1
        try:
            return self._open(request, url, headers)
        except FetchError:
            self.deadline.check()
            raise

    def _open(self, request, url: str, headers: dict[str, str] | None):
        try:
            return self.opener.open(request, timeout=min(self.timeout, self.deadline.left()))
        except urllib.error.HTTPError as exc:
            exc.close()
            if 300 <= exc.code < 400 and "infinite loop" in str(exc.reason):
                raise FetchError(
                    f"fetch: {host_of(url)} redirected more than {MAX_REDIRECTS} times",
                    host=host_of(url),
                ) from None
            if exc.code == 416:
                raise RangesRefused(f"it answered 416 to {headers}") from None
            raise FetchError(
                f"fetch: {host_of(url)} answered {exc.code} {exc.reason}",
                exc.code,
                host=host_of(url),
            ) from None
        except urllib.error.URLError as exc:
            raise FetchError(
                f"fetch: cannot reach {host_of(url)}: {exc.reason}", host=host_of(url)
            ) from None
        except (http.client.HTTPException, OSError, ValueError) as exc:
            raise FetchError(
                f"fetch: {host_of(url)} failed: {_said(exc)}", host=host_of(url)
            ) from None

    def page(self, url: str, limit: int, accept: str) -> Page | None:
        """An index page; None when the index has no such page (404, as pip takes it)."""
        try:
            response = self.open(url, {"Accept": accept})
        except FetchError as exc:
            if exc.status == 404:
                return None
            raise
        with response:
            _no_encoding(response, url)
            body = self.read_body(response, limit, url)
            return Page(response.geturl(), response.headers.get("Content-Type", ""), body)

    def read_body(self, response, limit: int, url: str) -> bytes:
        """The whole body, refused past ``limit`` bytes."""
        declared = _content_length(response, url)
        if declared is not None and declared > limit:
            raise FetchError(
                f"fetch: {host_of(url)} sent {declared:,} bytes, over {limit:,}", host=host_of(url)
            )
        data = self._read(response, limit + 1, url)
        if len(data) > limit:
            raise FetchError(
                f"fetch: {host_of(url)} sent more than {limit:,} bytes", host=host_of(url)
            )
        return data

    def read_range(self, url: str, start: int, end: int, total: int) -> bytes:
        """Bytes [start, end) of a file of ``total`` bytes, by one range request."""
        response = self.open(url, {"Range": f"bytes={start}-{end - 1}", **IDENTITY})
        with response:
            check_partial(response, url)
            first, last, size = content_range(response, url)
            if (first, last + 1, size) != (start, end, total):
                raise FetchError(
                    f"fetch: {host_of(url)} answered bytes {first}-{last}/{size} "
                    f"to a request for {start}-{end - 1}/{total}",
                    host=host_of(url),
                )
            return self.read_exactly(response, end - start, url)

    def read_exactly(self, response, length: int, url: str) -> bytes:
        declared = _content_length(response, url)
        if declared is not None and declared != length:
            raise FetchError(
                f"fetch: {host_of(url)} declared {declared:,} bytes for a range of {length:,}",
                host=host_of(url),
            )
        data = self._read(response, length + 1, url)
        if len(data) != length:
            raise FetchError(
                f"fetch: {host_of(url)} sent {len(data):,} bytes for a range of {length:,}",
                host=host_of(url),
            )
        return data

    def _read(self, response, most: int, url: str) -> bytes:
        try:
            data = self._read_some(response, most, url)
        except FetchError:
            self.deadline.check()
            raise
        self.deadline.check()  # a connection the deadline cut reads as a body that ended
        return data

    def _read_some(self, response, most: int, url: str) -> bytes:
        parts, got = [], 0
        try:
            while got < most:
                chunk = response.read(min(CHUNK, most - got))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
        except (http.client.HTTPException, OSError, ValueError) as exc:
            raise FetchError(
                f"fetch: reading from {host_of(url)} failed: {_said(exc)}", host=host_of(url)
            ) from None
        with self._counting:
            self.bytes_read += got
        return b"".join(parts)

    def stream_to(self, response, out, limit: int, url: str, digest) -> int:
        """Copy a whole body into the open file ``out`` (hashing it), at most ``limit`` bytes."""
        declared = _content_length(response, url)
        if declared is not None and declared > limit:
            raise FetchError(
                f"fetch: {host_of(url)} sent {declared:,} bytes, over {limit:,}", host=host_of(url)
            )
        written = 0
        while True:
            chunk = self._read(response, min(CHUNK, limit + 1 - written), url)
            if not chunk:
                return written
            written += len(chunk)
            if written > limit:
                raise FetchError(
                    f"fetch: {host_of(url)} sent more than {limit:,} bytes", host=host_of(url)
                )
            digest.update(chunk)
            out.write(chunk)


IDENTITY = {"Accept-Encoding": "identity"}


def _tls(cert: str | None) -> ssl.SSLContext | None:
    """pip's ``cert`` as the CA bundle (None: the system's)."""
    if not cert:
        return None
    try:
        return ssl.create_default_context(cafile=cert)
    except (OSError, ssl.SSLError) as exc:
        raise FetchError(f"fetch: pip's cert {cert[:200]} cannot be used: {_said(exc)}") from None


class _Addresses:
    """Each host looked up once a fetch: a fetch opens a connection a request (urllib
    keeps none alive), and here one DNS answer in about 40 came after a 5 s retry."""

    def __init__(self):
        self.lock = threading.Lock()
        self.known: dict[tuple[str, int], list] = {}
        self.lookups = 0

    def addresses(self, host: str, port: int) -> list:
        with self.lock:
            if (host, port) not in self.known:
                self.lookups += 1
                self.known[(host, port)] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
            return self.known[(host, port)]

    def connect(self, address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
        """socket.create_connection, with the addresses looked up once."""
        host, port = address
        failure: OSError | None = None
        for family, kind, proto, _, where in self.addresses(host, port):
            sock = socket.socket(family, kind, proto)
            try:
                if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                    sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(where)
                return sock
            except OSError as exc:
                failure = exc
                sock.close()
        raise failure or OSError(f"{host} has no address")


def _connections(addresses: _Addresses, deadline: Deadline):
    """http.client's connection classes, connecting through ``addresses``; each socket
    (after TLS, the TLS one) is watched by ``deadline``."""

    class Plain(http.client.HTTPConnection):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._create_connection = addresses.connect

        def connect(self):
            super().connect()
            deadline.watch(self.sock)

    class Secure(http.client.HTTPSConnection):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._create_connection = addresses.connect

        def connect(self):
            super().connect()
            deadline.watch(self.sock)

    return Plain, Secure


def deadline_seconds(env) -> float:
    """PATCHKIT_FETCH_DEADLINE, in seconds (a positive, finite number), else DEADLINE."""
    value = env.get("PATCHKIT_FETCH_DEADLINE")
    if not value:
        return DEADLINE
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise DeadlineInvalid(
            f"fetch: PATCHKIT_FETCH_DEADLINE={value[:40]!r} is not a positive number of seconds",
            value=value,
        )
    return seconds


class Deadline:
    """One bound on a whole fetch, not only on each wait: a server sending one byte a
    second never lets a socket timeout fire. When it passes, a timer thread shuts down
    every socket the fetch still has open, which wakes any read (status line, headers or
    body, plain or TLS); the failure that follows is reported as the deadline's."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ends = time.monotonic() + seconds
        self.sockets: weakref.WeakSet = weakref.WeakSet()
        self.lock = threading.Lock()
        self.passed = False
        self.timer: threading.Timer | None = None

    def left(self) -> float:
        """Seconds left; the deadline's FetchError when none are."""
        left = self.ends - time.monotonic()
        if left <= 0:
            self.passed = True
        self.check()
        return left

    def check(self) -> None:
        if self.passed:
            raise FetchError(
                f"fetch: stopped after {self.seconds:g} s, the bound on one whole fetch "
                "(PATCHKIT_FETCH_DEADLINE)",
                deadline=self.seconds,
            )

    def watch(self, sock) -> None:
        with self.lock:
            self.sockets.add(sock)
            if self.timer is None:
                self.timer = threading.Timer(max(0.0, self.ends - time.monotonic()), self._cut)
                self.timer.daemon = True
                self.timer.start()
            if self.passed:
                self._cut_one(sock)

    def cancel(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()

    def _cut(self) -> None:
        with self.lock:
            self.passed = True
            for sock in list(self.sockets):
                self._cut_one(sock)

    @staticmethod
    def _cut_one(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass  # closed already


class _PlainHandler(urllib.request.HTTPHandler):
    def __init__(self, connection):
        super().__init__()
        self.connection = connection

    def http_open(self, req):
        return self.do_open(self.connection, req)


class _SecureHandler(urllib.request.HTTPSHandler):
    def __init__(self, connection, context):
        super().__init__(context=context)
        self.connection = connection
        self.tls = context

    def https_open(self, req):
        return self.do_open(self.connection, req, context=self.tls)


def check_partial(response, url: str) -> None:
    """A range answer is a 206 of unencoded bytes; anything else means no ranges here."""
    if response.status != 206:
        raise RangesRefused(f"it answered {response.status} to a range request")
    _no_encoding(response, url)


def content_range(response, url: str) -> tuple[int, int, int]:
    """(first, last, total) of a 206's Content-Range, checked for sense."""
    value = response.headers.get("Content-Range", "")
    match = CONTENT_RANGE.fullmatch(value.strip())
    if not match:
        raise FetchError(
            f"fetch: {host_of(url)} sent a Content-Range of {value[:60]!r}", host=host_of(url)
        )
    first, last, total = (int(g) for g in match.groups())
    if not first <= last < total:
        raise FetchError(
            f"fetch: {host_of(url)} sent a Content-Range of {value[:60]!r}", host=host_of(url)
        )
    return first, last, total


def _no_encoding(response, url: str) -> None:
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise FetchError(
            f"fetch: {host_of(url)} sent a {encoding[:20]!r}-encoded body", host=host_of(url)
        )


def _content_length(response, url: str) -> int | None:
    value = response.headers.get("Content-Length")
    if value is None:
        return None
    if not DIGITS.fullmatch(value.strip()):
        raise FetchError(
            f"fetch: {host_of(url)} sent a Content-Length of {value[:30]!r}", host=host_of(url)
        )
    return int(value)


def _netloc(parts: urllib.parse.SplitResult) -> str:
    host = (parts.hostname or "").lower()
    return f"{host}:{parts.port or {'http': 80, 'https': 443}.get(parts.scheme, 0)}"


def _index_credentials(urls) -> dict[str, tuple[str, str]]:
    found = {}
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None:
            found.setdefault(
                _netloc(parts),
                (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")),
            )
    return found


def _said(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160]


class _Redirects(urllib.request.HTTPRedirectHandler):
    """At most MAX_REDIRECTS, only to http(s), never from https down to http. The new
    request carries the old one's credentials on the same host and port, and only the
    new host's own (its URL's, its index's, netrc's) on another."""

    max_redirections = MAX_REDIRECTS
    max_repeats = 2

    def __init__(self, transport: Transport):
        self.transport = transport

    def http_error_302(self, req, fp, code, msg, headers):
        """The new URL's scheme is checked first (urllib itself would follow ftp:)."""
        location = headers.get("Location") or headers.get("URI")
        if location:
            _followable(req.full_url, urllib.parse.urljoin(req.full_url, location))
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        _followable(req.full_url, newurl)
        request = super().redirect_request(req, fp, code, msg, headers, without_credentials(newurl))
        if request is None:
            return None
        auth = req.unredirected_hdrs.get("Authorization")
        if _netloc(old) == _netloc(new) and auth:
            request.add_unredirected_header("Authorization", auth)
        else:
            self.transport.authorize(request, newurl)
        return request


def _followable(old_url: str, new_url: str) -> None:
    old, new = urllib.parse.urlsplit(old_url), urllib.parse.urlsplit(new_url)
    if new.scheme not in ("http", "https") or (old.scheme == "https" and new.scheme != "https"):
        raise FetchError(
            f"fetch: {old.hostname} redirected to a {new.scheme[:10] or 'relative'}: URL, "
            "which fetch does not follow"
        )
