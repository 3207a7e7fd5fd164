"""``patchkit fetch VERSION``: a pristine vLLM release tree from its PyPI wheel.

The wheel is the one ``pip download vllm==VERSION`` would take (CPython 3.12,
x86_64 Linux), found through the index pip is configured with
(:mod:`patchkit.releases.index`). fetch is never weaker than pip: the whole
wheel is downloaded (streamed to a file in the staging directory, never held
in memory) and its sha256 checked against the index's before anything is
unpacked, so the tree comes only from bytes the index vouches for. Then only
its Python files and its ``vllm-VERSION.dist-info/`` are unpacked into an
install-like directory, so ``--target`` sees exactly what ``pip install``
would have put in site-packages; each file is checked against the wheel's own
RECORD before it is written (:mod:`patchkit.releases.members`). Compiled
extensions are left out: patches touch Python files only, and the tree stays
small. The wheel is deleted after unpacking; the tree is the cache.

``trust_ranges`` (``fetch --trust-ranges``, off by default) reads only those
members by HTTP range requests, about 8 MB of a 300 MB wheel: the index's
sha256 of the whole file cannot be checked then, only RECORD, which whoever
can change the file can rewrite too; it trusts the host. The test suite's
release cache uses it. A server that refuses ranges gets the whole wheel,
checked, and one line saying so.

A killed fetch must not leave work behind: the staging directory holds a
marker file patchkit writes first (its pid and the process's start time), so
the next fetch removes the staging directories of dead runs, and only
those: a directory is never recognised by its name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import tempfile
import urllib.parse
from pathlib import Path

from packaging.version import Version

from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.fs.files import open_regular
from patchkit.fs.places import cache_root
from patchkit.fs.safepath import Root, UnsafePath, mount_id, remove_entry
from patchkit.identity import is_version
from patchkit.releases.index import WheelLink, find_wheel
from patchkit.releases.members import (
    MAX_WHEEL,
    Fetched,
    extract,
    hash_file,
    local_source,
    remote_source,
)
from patchkit.releases.pipconfig import PipSettings, pip_settings
from patchkit.releases.transport import (
    FetchError,
    RangesRefused,
    Transport,
    WheelMismatch,
    host_of,
)
from patchkit.releases.wheelzip import BadWheel
from patchkit.signals import held
from patchkit.terminal import printable

MARKER = ".patchkit-fetched"
STAGING_MARKER = ".patchkit-staging"
WHOLE_WHEEL = "wheel.whl"  # the whole wheel, in the staging directory


class VersionInvalid(PatchkitError):
    """The release asked for is no version (``version``)."""

    code = Code.VERSION_INVALID


class DestUnusable(PatchkitError):
    """--dest (``path``) cannot take the tree: a link, a path with '..', or a directory
    that holds something else."""

    code = Code.DEST_UNUSABLE


def fetch(
    version: str, dest: Path | None = None, progress: bool = False, trust_ranges: bool = False
) -> Path:
    """Return a directory holding vllm/ and its dist-info for ``version``; ``trust_ranges``
    reads it by range requests, without the check of the whole wheel's sha256."""
    if not is_version(version):
        raise VersionInvalid(
            f"fetch: {version[:40]!r} is not a version (e.g. 0.26.0)", version=version
        )
    version = str(Version(version))  # v0.26.0 (a Docker tag) is 0.26.0: one release, one tree
    own = dest is None  # only patchkit's own cache is swept for dead fetches
    dest = _checked_dest(Path(dest)) if dest else cache_root() / "trees" / f"vllm-{version}"
    if own and dest.parent.is_dir():
        remove_stale_staging(dest.parent)
    if (dest / MARKER).is_file():
        if (dest / ".patchkit").exists():
            say(
                f"note: {dest} has patchkit changes applied "
                f"(`patchkit revert --target {shlex.quote(str(dest))}` undoes them)"
            )
        return dest
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise DestUnusable(
            f"fetch: {dest} exists and is not a patchkit tree; pass an empty --dest", path=dest
        )
    settings = pip_settings()  # pip's settings and the deadline: refused before any write
    transport = Transport(settings)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with held():  # a staging directory is never left without its marker
        tmp = Path(tempfile.mkdtemp(prefix=f".vllm-{version}-", dir=dest.parent))
        (tmp / STAGING_MARKER).write_text(json.dumps(_this_process()))
    try:
        staging = tmp / "tree"
        wheel = _fetch_members(version, settings, transport, tmp, progress, trust_ranges)
        (staging / MARKER).write_text(f"{wheel}\n")
        os.replace(staging, dest)  # over an empty --dest too, in one step: never removed first
    finally:
        _remove_staging(dest.parent, tmp.name)
    return dest


def _checked_dest(dest: Path) -> Path:
    """--dest as given: a '..' in it (its parent is not where it looks: the staging
    directory beside it would land elsewhere) or a link (the tree would land elsewhere)
    is refused in one line."""
    if ".." in dest.parts:
        raise DestUnusable(f"fetch: --dest {dest} holds '..'; give the directory itself", path=dest)
    if dest.is_symlink():
        raise DestUnusable(
            f"fetch: --dest {dest} is a symbolic link; give the directory it points to", path=dest
        )
    return dest


def say(line: str) -> None:
    """One line on stderr, escaped: it may carry the index's data (a wheel's name)."""
    print(printable(line), file=sys.stderr)


def _this_process() -> dict:
    return {"pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def remove_stale_staging(directory: Path) -> list[Path]:
    """Delete the staging directories of fetches whose process is gone (killed runs).

    Called on patchkit's own cache only (never beside a `--dest`, where the
    user's directories live). A staging directory is one named `.vllm-...`
    that holds patchkit's marker file: a user's directory that only looks like
    one by its name is never touched.
    The marker is read, and the contents removed, through one descriptor of
    that directory: swapping another directory in under its name cannot
    redirect the removal.
    """
    removed = []
    with Root.open(directory) as fs:
        for name in fs.names("", "fetch"):
            if name.startswith(".vllm-") and _remove_if_dead_staging(fs, name):
                removed.append(directory / name)
    return removed


def _remove_if_dead_staging(fs: Root, name: str) -> bool:
    try:
        staging = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fs.fd
        )
    except OSError:
        return False  # not a directory, a link, or gone
    with Root(fs.full(name), staging) as held_open:  # closes the descriptor
        if not _dead_marker(held_open):
            return False
        with held():
            _empty_staging(held_open.fd, held_open.path)
    try:
        os.rmdir(name, dir_fd=fs.fd)  # only an empty directory goes; a swapped-in one is not
    except OSError:
        pass
    return True


def _dead_marker(staging: Root) -> bool:
    try:
        marker = json.loads(staging.read(STAGING_MARKER, "fetch") or b"null")
    except (ValueError, RecursionError, UnsafePath, OSError):
        return False
    if not isinstance(marker, dict) or not isinstance(marker.get("pid"), int):
        return False
    return not _alive(marker["pid"], marker.get("start"))


def _empty_staging(fd: int, path: Path) -> None:
    """Everything in a staging directory, the marker last (an interrupted cleanup stays
    recognisable); never following a link or leaving the mount."""
    mount = mount_id(fd)
    names = sorted(os.listdir(fd), key=lambda n: n == STAGING_MARKER)
    for name in names:
        remove_entry(fd, name, mount, path / name)


def _remove_staging(directory: Path, name: str) -> None:
    """Remove this run's own staging directory (signals held: all of it or the marker stays)."""
    try:
        with held(), Root.open(directory) as fs:
            staging = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fs.fd
            )
            try:
                _empty_staging(staging, directory / name)
            finally:
                os.close(staging)
            os.rmdir(name, dir_fd=fs.fd)
    except (OSError, UnsafePath):
        pass  # left for the next fetch, which finds it by its marker


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):
        return False  # no process can have such a pid
    except PermissionError:
        pass
    return start is None or _start_time(pid) in (None, start)


def _fetch_members(
    version: str,
    settings: PipSettings,
    transport: Transport,
    tmp: Path,
    progress: bool,
    trust_ranges: bool,
) -> str:
    """The wanted members of the release's wheel into ``tmp/tree``; the wheel's name."""
    try:
        link = find_wheel(version, settings, transport)
        os.mkdir(tmp / "tree")
        with Root.open(tmp / "tree") as staging:
            fetched = _unpack(link, transport, tmp, staging, trust_ranges)
    finally:
        transport.close()
    if not (tmp / "tree" / "vllm" / "__init__.py").is_file():
        raise BadWheel(f"fetch: {link.filename} holds no vllm/ package", wheel=link.filename)
    if progress:
        say(_summary(link, fetched, transport))
    return link.filename


def _unpack(
    link: WheelLink, transport: Transport, tmp: Path, staging: Root, trust_ranges: bool
) -> Fetched:
    """A local wheel in place; a remote one whole (checked), or by ranges when trusted."""
    if link.is_local:
        return _from_local_file(link, staging)
    if not trust_ranges:
        return _from_whole_wheel(link, transport, tmp, staging)
    try:
        source = remote_source(link.url, link.filename, link.size, transport)
        return extract(source, _wanted, staging, link.version)
    except RangesRefused as refused:
        say(
            f"fetch: {link.host} does not serve byte ranges ({refused.why}); "
            f"downloading the whole {link.filename}{_megabytes(link.size)}"
        )
        return _from_whole_wheel(link, transport, tmp, staging, refused.response)


def _from_local_file(link: WheelLink, staging: Root) -> Fetched:
    """A find-links wheel, read in place: a regular file (fs.files.open_regular: a FIFO or a device
    named like a wheel is refused, never waited on), at most MAX_WHEEL bytes. The link's
    file: URL is decoded ('+' of a local version is %2B there)."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(link.url).path)
    try:
        fd = open_regular(path, MAX_WHEEL)
    except OSError as exc:
        raise FetchError(f"fetch: cannot read {path}: {exc.strerror}", path=path) from None
    except ValueError as exc:
        raise FetchError(f"fetch: cannot read {path}: {exc}", path=path) from None
    try:
        hash_file(fd, link.filename, link.sha256, link.size)
        return extract(local_source(fd, link.filename), _wanted, staging, link.version)
    finally:
        os.close(fd)


def _from_whole_wheel(
    link: WheelLink,
    transport: Transport,
    tmp: Path,
    staging: Root,
    response=None,
) -> Fetched:
    """The whole wheel streamed into the staging directory (sha256 and size as the index
    says), then its members as from any local wheel; ``response``: a 200 that refused a
    range is that download already."""
    if response is None or response.status != 200:
        if response is not None:
            response.close()
        response = transport.open(link.url, {"Accept-Encoding": "identity"})
    limit = link.size if link.size is not None else MAX_WHEEL
    digest = hashlib.sha256()
    with Root.open(tmp) as holder, response:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(WHOLE_WHEEL, flags, 0o600, dir_fd=holder.fd)  # not the index's name
        try:
            with os.fdopen(os.dup(out), "wb") as writer:
                transport.stream_to(response, writer, limit, link.url, digest)
            if link.sha256 and digest.hexdigest() != link.sha256.lower():
                raise WheelMismatch(
                    f"fetch: {link.filename} does not match its index's sha256",
                    wheel=link.filename,
                )
            hash_file(out, link.filename, None, link.size)
            fetched = extract(local_source(out, link.filename), _wanted, staging, link.version)
        finally:
            os.close(out)
    fetched.whole = True
    return fetched


def _megabytes(size: int | None) -> str:
    return "" if size is None else f" ({size / 1e6:,.0f} MB)"


def _summary(link: WheelLink, fetched: Fetched, transport: Transport) -> str:
    if not (fetched.whole or link.is_local):
        checked = "by ranges, trusting the host (the wheel's sha256 not checked)"
    elif link.sha256:
        checked = "the wheel's sha256 checked"
    else:
        checked = "the index gives no sha256 to check"
    how = f"in {transport.requests} requests, {transport.bytes_read / 1e6:,.1f} MB read, {checked}"
    return (
        f"fetch: {fetched.members:,} files ({fetched.wanted_bytes / 1e6:,.1f} MB) of "
        f"{link.filename}{_megabytes(link.size)} from {host_of(link.url)}, {how}"
    )


def _wanted(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    return top == "vllm" and name.endswith((".py", ".pyi"))
