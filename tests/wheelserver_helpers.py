"""A real wheel of real vLLM files, and a package index serving it, for fetch's tests.

The wheel is built here the way a wheel is built (zip, deflate, a RECORD of
sha256 hashes and sizes) from the real 0.26.0 tree's files (the slim set:
vllm/__init__.py, vllm/lora/..., its dist-info), with a compiled extension
between them (incompressible bytes fetch must skip, as it skips the real
.so files). The index is http.server in a thread: a PEP 691 JSON or PEP 503
HTML project page, and the wheel with or without byte ranges, behind Basic
credentials or a proxy when asked; each request is recorded, and a test can
make any answer hostile. An index of several releases (``Index(wheels={NAME: BYTES})``)
lists and serves each wheel by its own name; tests/release_drill_helpers.py makes a
release the index has not published yet from a real tree.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import threading
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
EXTENSION = "vllm/_C.abi3.so"
EXTENSION_BYTES = 3 << 20


def wanted(name: str) -> bool:
    """What fetch keeps of a wheel (and what the full download kept): vllm's Python
    files and the dist-info."""
    top = name.split("/", 1)[0]
    return top.endswith(".dist-info") or (top == "vllm" and name.endswith((".py", ".pyi")))


def build_wheel(
    tree: Path, path: Path, zip64: bool = False, extra: dict | None = None, rows: dict | None = None
) -> Path:
    """A wheel of ``tree``'s files (vllm/... then the dist-info, RECORD last), with a
    compiled extension after vllm/__init__.py. ``zip64`` writes zip64 records for every
    offset; ``extra`` adds members (name -> bytes) that RECORD lists as they are; ``rows``
    replaces a member's RECORD row (name -> (hash, size), or None to leave it out)."""
    files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.name.startswith(".patchkit"))
    code = [p for p in files if p.relative_to(tree).parts[0] == "vllm"]
    dist = [p for p in files if p.relative_to(tree).parts[0].endswith(".dist-info")]
    members: list[tuple[str, bytes]] = []
    for p in code:
        members.append((p.relative_to(tree).as_posix(), p.read_bytes()))
        if p.name == "__init__.py" and p.parent == tree / "vllm":
            members.append((EXTENSION, _incompressible(EXTENSION_BYTES)))
    members += [(n, d) for n, d in (extra or {}).items()]
    record_name = next(p for p in dist if p.name == "RECORD").relative_to(tree).as_posix()
    members += [
        (p.relative_to(tree).as_posix(), p.read_bytes()) for p in dist if p.name != "RECORD"
    ]
    listed = {n: (f"sha256={urlsafe(hashlib.sha256(d).digest())}", str(len(d))) for n, d in members}
    listed.update(rows or {})
    table = [(n, *row) for n, row in listed.items() if row is not None]
    members.append((record_name, _csv([*table, (record_name, "", "")])))
    limit = 64 if zip64 else zipfile.ZIP64_LIMIT
    with mock.patch.object(zipfile, "ZIP64_LIMIT", limit):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in members:
                archive.writestr(name, data)
    return path


def urlsafe(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _csv(rows) -> bytes:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue().encode()


def _incompressible(size: int) -> bytes:
    block = hashlib.sha256(b"extension").digest()
    out, counter = bytearray(), 0
    while len(out) < size:
        out += hashlib.sha256(block + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def extracted(wheel: Path, dest: Path) -> Path:
    """The wanted members of ``wheel`` unpacked with zipfile: the full download's way."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if wanted(member.filename):
                archive.extract(member, dest)
    return dest


def tree_files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and permission bits; fetch's marker aside."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            relpath = path.relative_to(root).as_posix()
            if relpath != ".patchkit-fetched":
                out[relpath] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return out


@dataclass
class Index:
    """What the index serves and how; ``seen`` records each request."""

    wheel: bytes = b""
    wheels: dict | None = None  # name -> bytes: the page lists these instead of `wheel`
    ranges: bool = True
    json_page: bool = True
    credentials: tuple[str, str] | None = None
    proxy: bool = False  # answers absolute-URI requests (a proxy), and only those
    page_sha256: str | None = None  # None: the wheel's own
    page_size: int | None = None  # None: the wheel's own; -1 leaves it out
    filename: str = WHEEL  # the name the JSON page gives
    page_entry: dict = field(default_factory=dict)  # more keys of the JSON page's file entry
    hostile: dict = field(default_factory=dict)  # see Handler._file
    hold: threading.Event | None = None  # set: range requests before the tail wait for it
    holding: threading.Event = field(default_factory=threading.Event)  # one waits on hold
    seen: list = field(default_factory=list)
    sent: int = 0  # body bytes of the wheel sent
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Handler(BaseHTTPRequestHandler):
    index: Index

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 (http.server's name)
        index = self.index
        path = self.path
        absolute = path.startswith("http://")
        index.seen.append(
            {"path": path, "range": self.headers.get("Range"),
             "auth": self.headers.get("Authorization"), "host": self.headers.get("Host")}
        )  # fmt: skip
        if index.proxy != absolute:
            return self._send(502 if index.proxy else 400, b"wrong kind of request")
        if absolute:
            path = "/" + path.split("/", 3)[3]
        if index.credentials and not self._authorized():
            return self._send(401, b"credentials", {"WWW-Authenticate": 'Basic realm="x"'})
        if path in index.hostile.get("redirect", {}):
            return self._send(302, b"", {"Location": index.hostile["redirect"][path]})
        if path == "/simple/vllm/" and "drip" in index.hostile:
            return self._drip(index.hostile["drip"])
        if path == "/simple/vllm/":
            return self._page()
        served = index.wheels if index.wheels is not None else {WHEEL: index.wheel}
        name = path.removeprefix("/files/")
        if path.startswith("/files/") and name in served:
            return self._file(served[name])
        return self._send(404, b"not here")

    def _authorized(self) -> bool:
        user, password = self.index.credentials
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return self.headers.get("Authorization") == f"Basic {token}"

    def _page(self):
        """The project page; ``hostile["page"]`` (bytes) is served in its place, with the
        JSON page's Content-Type."""
        index = self.index
        if "page" in index.hostile:
            kind = "application/vnd.pypi.simple.v1+json"
            return self._send(200, index.hostile["page"], {"Content-Type": kind})
        if index.wheels is not None:
            listed = [(name, name, data, None, None) for name, data in index.wheels.items()]
        else:
            listed = [(index.filename, WHEEL, index.wheel, index.page_sha256, index.page_size)]
        entries, anchors = [], []
        for filename, served, data, sha, size in listed:
            sha = sha or hashlib.sha256(data).hexdigest()
            size = len(data) if size is None else size
            url = f"../../files/{served}"
            entry = {"filename": filename, "url": url, "hashes": {"sha256": sha}}
            entry.update(index.page_entry)
            if size >= 0:
                entry["size"] = size
            entries.append(entry)
            anchors.append(f'<a href="{url}#sha256={sha}">{served}</a>')
        if index.json_page:
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": "vllm", "files": entries})
            kind = "application/vnd.pypi.simple.v1+json"
        else:
            body = f"<html><body>{''.join(anchors)}</body></html>"
            kind = "text/html"
        self._send(200, body.encode(), {"Content-Type": kind})

    def _file(self, wheel: bytes):
        """A wheel; ``hostile`` keys change the range answer: content_range (a function of
        (start, end, total) giving the header), extra_bytes (sent beyond the range),
        short_by (bytes left out), status (for range requests), accept_ranges (its header),
        body (the bytes served)."""
        index, hostile = self.index, self.index.hostile
        data = hostile.get("body", wheel)
        asked = self.headers.get("Range")
        if not (index.ranges and asked):
            return self._send(200, data, {"Content-Type": "application/octet-stream"}, count=True)
        start, end = _parse_range(asked, len(data))
        if index.hold is not None and end < len(data):
            index.holding.set()  # a test waits for this, not for a while
            index.hold.wait(60)  # a server that has stopped answering
        header = hostile.get("content_range", lambda a, b, t: f"bytes {a}-{b - 1}/{t}")
        body = data[start:end] + b"\0" * hostile.get("extra_bytes", 0)
        body = body[: len(body) - hostile.get("short_by", 0)]
        headers = {"Content-Range": header(start, end, len(data)),
                   "Accept-Ranges": hostile.get("accept_ranges", "bytes")}  # fmt: skip
        self._send(hostile.get("status", 206), body, headers, count=True)

    def _drip(self, until: threading.Event):
        """A page that never ends: a byte at a time, each soon after the last (no socket
        timeout fires), until ``until`` is set or the client hangs up."""
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        while not until.wait(0.05):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return

    def _send(self, status: int, body: bytes, headers: dict | None = None, count: bool = False):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            return  # fetch stopped reading: what a bounded reader does
        if count:
            self.index.sent += len(body)


def _parse_range(value: str, total: int) -> tuple[int, int]:
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", value.strip())
    first, last = match.groups()
    if not first:
        return max(0, total - int(last)), total
    return int(first), min(total, int(last) + 1) if last else total


@contextmanager
def serving(index: Index):
    """The index on 127.0.0.1 while the block runs."""
    handler = type("BoundHandler", (Handler,), {"index": index})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    index.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01})
    thread.daemon = True
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()


PIP_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_PROXY",
           "PIP_CERT", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy",
           "NO_PROXY", "all_proxy", "ALL_PROXY", "NETRC")  # fmt: skip


def only_this_index(monkeypatch, index_url: str, home: Path) -> None:
    """pip's settings of this process: ``index_url`` and nothing from the machine."""
    for name in PIP_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc of the machine's


def wheel_name(version: str) -> str:
    return WHEEL.replace("0.26.0", version)
