"""Only the wanted members of a wheel, read by byte ranges, checked, written into staging.

The wheel is a *source* of byte ranges: a local file (the whole wheel
downloaded and checked against the index's sha256, the default, or one on the
index's file system) or, with ``--trust-ranges``, a remote file read with HTTP
range requests. Either way the same steps run: the tail, the central
directory, the one ``vllm-VERSION.dist-info`` (pip refuses a wheel with more),
the declared sizes of the wanted members summed against MAX_UNPACKED, that
dist-info's RECORD read first, on its own, then the other wanted members'
spans coalesced into few reads (fetched a few at a time, so a far server's
latency is paid a few times, not once a member), each member inflated (no
further than its declared size), checked against its CRC and then RECORD,
and written at once under the staging directory while the other reads go on,
through :class:`patchkit.fs.safepath.Root` (descriptor walks, no links
followed, a name that would leave the tree refused)"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from patchkit.errors import OsFailure
from patchkit.fs.safepath import Root, UnsafePath, checked_relpath
from patchkit.releases import wheelzip
from patchkit.releases.record import check_member, parse_record
from patchkit.releases.transport import (
    IDENTITY,
    FetchError,
    RangesRefused,
    Transport,
    WheelMismatch,
    check_partial,
    content_range,
    host_of,
)

TAIL_READ = 1 << 20  # the end record, and for a vLLM wheel its directory and RECORD too
GAP = 1 << 16  # members closer than this come in one read
MOST = 16 << 20  # bytes one coalesced read may span
WORKERS = 4
MAX_WHEEL = 8 << 30  # a whole wheel downloaded
MAX_UNPACKED = 512 << 20  # all kept members together; vLLM 0.34.0's are 64 MB


@dataclass
class Source:
    """A file readable by ranges: ``read(start, end)``; ``size`` bytes in all."""

    what: str  # the wheel's name, for messages
    size: int
    read: Callable[[int, int], bytes]
    tail: bytes = b""  # the last bytes, when the first request already brought them


@dataclass
class Fetched:
    """What a fetch read, for its one-line summary."""

    members: int = 0
    wanted_bytes: int = 0
    reads: int = 0
    whole: bool = False  # the whole wheel was downloaded (and its sha256 checked)


def remote_source(url: str, filename: str, size: int | None, transport: Transport) -> Source:
    """The wheel at ``url`` read by ranges; RangesRefused (holding the open 200 answer
    where there is one) when the server does not serve them."""
    response = transport.open(url, {"Range": f"bytes=-{TAIL_READ}", **IDENTITY})
    try:
        if response.status == 206 and response.headers.get("Accept-Ranges", "") == "none":
            raise RangesRefused("it sent Accept-Ranges: none")
        check_partial(response, url)
        first, last, total = content_range(response, url)
        if last != total - 1 or last - first + 1 > TAIL_READ:
            raise FetchError(
                f"fetch: {host_of(url)} answered bytes {first}-{last}/{total} "
                f"to a request for the last {TAIL_READ:,}",
                host=host_of(url),
            )
        if size is not None and total != size:
            raise FetchError(
                f"fetch: {filename} is {total:,} bytes at {host_of(url)}, the index says {size:,}",
                host=host_of(url),
            )
        tail = transport.read_exactly(response, last - first + 1, url)
    except RangesRefused as refused:
        refused.response = response  # the caller may read the whole body from it
        raise
    except BaseException:
        response.close()
        raise
    response.close()

    def read(start: int, end: int) -> bytes:
        return transport.read_range(url, start, end, total)

    return Source(filename, total, read, tail)


def local_source(fd: int, filename: str) -> Source:
    """A wheel in an open local file."""
    size = os.fstat(fd).st_size

    def read(start: int, end: int) -> bytes:
        data = os.pread(fd, end - start, start)
        if len(data) != end - start:
            raise WheelMismatch(f"fetch: {filename} changed while it was read", wheel=filename)
        return data

    return Source(filename, size, read)


def hash_file(fd: int, filename: str, sha256: str | None, size: int | None) -> None:
    """The whole local wheel against the index's sha256 and size, where the index gives them."""
    actual = os.fstat(fd).st_size
    if size is not None and actual != size:
        raise WheelMismatch(
            f"fetch: {filename} is {actual:,} bytes, the index says {size:,}", wheel=filename
        )
    if sha256 is None:
        return
    digest, at = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, at):
        digest.update(chunk)
        at += len(chunk)
    if digest.hexdigest() != sha256.lower():
        raise WheelMismatch(f"fetch: {filename} does not match its index's sha256", wheel=filename)


def extract(
    source: Source, wanted: Callable[[str], bool], staging: Root, version: Version
) -> Fetched:
    """The members ``wanted`` names, from ``source`` into ``staging``: the wheel's own
    ``vllm-VERSION.dist-info/RECORD`` first, then each member checked against it and
    written as it comes (none held back), their declared sizes at most MAX_UNPACKED in all."""
    what = source.what
    tail_start = source.size - len(source.tail)
    if not source.tail:
        tail_start = max(0, source.size - wheelzip.TAIL)
        source.tail = source.read(tail_start, source.size)
    directory = wheelzip.locate_directory(source.tail, tail_start, source.size, source.read, what)
    data = _from_tail(source, tail_start, directory.offset, directory.offset + directory.size)
    members = wheelzip.read_directory(data, directory, what)
    dist_info = _own_dist_info(members, version, what)
    record_name = f"{dist_info}/RECORD"
    chosen = [m for m in members if wanted(m.name) and m.name not in _signatures(dist_info)]
    if not any(m.name == record_name for m in chosen):
        raise wheelzip.BadWheel(f"fetch: {what} has no {record_name}", wheel=what)
    spans = wheelzip.spans(members, chosen, directory, what)  # each member's own bound
    _check_total(chosen, what)
    [(start, end, record_member)] = [s for s in spans if s[2].name == record_name]
    record_bytes = wheelzip.member_bytes(
        record_member, _from_tail(source, tail_start, start, end), start, what
    )
    record = parse_record(record_bytes, what)
    ranges = wheelzip.coalesce([s for s in spans if s[2] is not record_member], GAP, MOST)
    fetched = Fetched(members=1, wanted_bytes=len(record_bytes))
    fetched.reads = sum(1 for r in ranges if r[0] < tail_start) + (start < tail_start)
    with _Writer(staging) as writer:
        writer.write(record_name, record_bytes)
        for name, content in _members(source, tail_start, ranges):
            check_member(name, content, record, what)
            writer.write(name, content)
            fetched.members += 1
            fetched.wanted_bytes += len(content)
    return fetched


def _own_dist_info(members: list[wheelzip.Member], version: Version, what: str) -> str:
    """The wheel's one top-level ``*.dist-info`` directory (pip refuses a wheel with more),
    and it must be vLLM's of the wheel's version (or of its public part: a +local build's
    file name), so no other package's RECORD is ever the one members are checked against."""
    found = sorted({m.name.split("/", 1)[0] for m in members if _is_dist_info(m.name)})
    if len(found) == 1:
        name, _, release = found[0].removesuffix(".dist-info").partition("-")
        try:
            ours = canonicalize_name(name) == "vllm" and Version(release) in (
                version,
                Version(version.public),
            )
        except InvalidVersion:
            ours = False
        if ours:
            return found[0]
    listed = ", ".join(repr(top[:80]) for top in found[:3]) or "none"
    raise wheelzip.BadWheel(
        f"fetch: {what} must hold one .dist-info directory, vllm-{version}'s; it holds {listed}",
        wheel=what,
    )


def _is_dist_info(name: str) -> bool:
    return name.split("/", 1)[0].endswith(".dist-info")


def _signatures(dist_info: str) -> tuple[str, ...]:
    """RECORD's signatures: RECORD cannot list them, nothing here checks them, so they are
    never written."""
    return (f"{dist_info}/RECORD.jws", f"{dist_info}/RECORD.p7s")


def _check_total(chosen: list[wheelzip.Member], what: str) -> None:
    """The declared sizes of the kept members, summed before any is read: inflating stops
    at each member's declared size, so this bounds what is inflated and written."""
    total = sum(m.size for m in chosen)
    if total > MAX_UNPACKED:
        raise wheelzip.BadWheel(
            f"fetch: {what}'s Python files and dist-info come to {total:,} bytes unpacked, "
            f"over the {MAX_UNPACKED:,} a vLLM tree may have",
            wheel=what,
        )


def _from_tail(source: Source, tail_start: int, start: int, end: int) -> bytes:
    if start >= tail_start:
        return source.tail[start - tail_start : end - tail_start]
    return source.read(start, end)


def _members(source: Source, tail_start: int, ranges):
    """(name, content) of each member: those in the tail first, then as reads end."""
    for start, _, held in ranges:
        if start >= tail_start:
            yield from _take(source, source.tail, tail_start, held)
    remote = [r for r in ranges if r[0] < tail_start]
    for decoded in _parallel(source, remote):
        yield from decoded


def _take(source: Source, data: bytes, data_start: int, held):
    for _, _, member in held:
        yield member.name, wheelzip.member_bytes(member, data, data_start, source.what)


def _read_and_inflate(source: Source, item) -> list[tuple[str, bytes]]:
    start, end, held = item
    return list(_take(source, source.read(start, end), start, held))


def _parallel(source: Source, ranges):
    """Each range's members, read and inflated (zlib lets go of the GIL) WORKERS at a
    time, as each read ends, in daemon threads: an interrupted fetch neither waits for
    them nor leaves them writing (they only read)."""
    if not ranges:
        return
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    for item in ranges:
        todo.put(item)

    def work() -> None:
        while True:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item, _read_and_inflate(source, item), None))
            except BaseException as exc:  # handed to the main thread, which raises it
                done.put((item, None, exc))
                return

    for _ in range(min(WORKERS, len(ranges))):
        threading.Thread(target=work, daemon=True).start()
    for _ in ranges:
        _, decoded, error = done.get()
        if error is not None:
            _drain(todo)
            raise error
        yield decoded


def _drain(todo: queue.Queue) -> None:
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            return


class _Writer:
    """Members into ``staging`` as they come: fresh files (O_EXCL, no link followed),
    each through a descriptor of its directory, walked from the staging root without
    links and kept open while the members of one directory follow each other."""

    def __init__(self, staging: Root):
        self.staging = staging
        self.origin = f"fetch: {staging.path.name}"
        self.directory: str | None = None
        self.held = ExitStack()
        self.fd = -1

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.held.close()

    def write(self, name: str, data: bytes) -> None:
        try:
            relpath = checked_relpath(name.rstrip("/"), self.origin, top=None)
        except UnsafePath as exc:
            raise wheelzip.BadWheel(f"{exc} (a member of the wheel)", cause=exc) from None
        head, _, base = relpath.rpartition("/")
        try:
            if name.endswith("/"):
                with self.staging.directory(relpath, self.origin, create=True):
                    return
            if head != self.directory:
                self.held.close()
                self.directory = None
                self.fd = self.held.enter_context(
                    self.staging.directory(head, self.origin, create=True)
                )
                self.directory = head
            _write_file(self.fd, base, data, self.staging.full(relpath))
        except OSError as exc:
            raise OsFailure(
                exc,
                "writing",
                path=self.staging.full(relpath),
                line=f"fetch: cannot write {self.staging.full(relpath)}: {exc.strerror}",
            ) from None


def _write_file(directory_fd: int, name: str, data: bytes, path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(name, flags, 0o666, dir_fd=directory_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    finally:
        os.close(out)
