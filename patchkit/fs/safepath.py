"""Every path patchkit reads, writes or deletes goes through here.

patchkit edits other people's site-packages, so a path that comes from
disk (``state.json``, the journal, a diff, a symlink) or from the
environment is hostile until checked. The rules, after what dpkg and git
promise about files they do not own:

* a relative path is POSIX, non-empty, without ``..``, ``.``, empty parts or
  NUL, and stays under its expected top directory (``vllm/`` for the code,
  ``.patchkit/`` for patchkit's own files);
* no component from the tree root down to the file may be a symbolic link:
  writing through one would change a file outside the tree, and replacing
  one would silently break the link;
* a check and the use it guards are one system call. :class:`Root` holds the
  tree's directory open and reaches every path below it from that
  descriptor, one component at a time (``openat`` with ``O_NOFOLLOW |
  O_DIRECTORY``), and acts on the last component relative to its parent's
  descriptor (``renameat``, ``unlinkat``). Swapping a directory for a link
  while patchkit runs then makes the walk fail; it can never redirect a
  write outside the tree;
* anything but a regular file where a file is expected (a FIFO, a device, a
  socket) is refused by its type before it is read, so nothing hangs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from patchkit.codes import Code
from patchkit.errors import PatchkitError

CODE_TOP = "vllm"
TMP_SUFFIX = ".patchkit-tmp"
# How many directories below its start a recursive walk (links, mounts, removal) goes:
# far past any tree, cache or .patchkit/ (vLLM's deepest file is 8 below vllm/), far
# from Python's recursion limit (1,200 directories under .patchkit/ raised RecursionError,
# exit 3, in every command).
MAX_DEPTH = 256
# The most a read through a Root takes unless its caller says less: far past any file
# patchkit reads in a tree, a cache or .git (vLLM's largest source file is 0.4 MB, a
# RECORD 0.3 MB); a 4 GiB sparse file once went whole into memory (MemoryError, or the
# kernel killing patchkit).
MAX_READ_BYTES = 64 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


class UnsafePath(PatchkitError):
    """A path that would lead outside the tree, through a link, or to a non-file: its
    facts are the path (``path``), where it came from (``origin``), and what it is
    (``kind``: a link's ``target``)."""

    code = Code.UNSAFE_PATH


class TooLarge(PatchkitError):
    """A file larger than its reader's bound: refused before it is read whole."""

    code = Code.FILE_TOO_LARGE

    def __init__(self, path: Path, limit: int):
        super().__init__(f"{path} is larger than {limit} bytes", path=path, limit=limit)


def checked_relpath(relpath: object, origin: str, top: str | None = CODE_TOP) -> str:
    """``relpath`` if it is clean, relative and under ``top``; else UnsafePath naming ``origin``."""
    if not isinstance(relpath, str) or not relpath:
        raise UnsafePath(f"{origin}: {relpath!r} is not a relative file path", origin=origin)
    parts = relpath.split("/")
    if (
        "\x00" in relpath
        or PurePosixPath(relpath).is_absolute()
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UnsafePath(
            f"{origin}: path {relpath!r} leaves the vLLM tree", path=relpath, origin=origin
        )
    if top is not None and (parts[0] != top or len(parts) < 2):
        raise UnsafePath(
            f"{origin}: path {relpath!r} is not under {top}/", path=relpath, origin=origin
        )
    return relpath


def kind_of(mode: int) -> str:
    """'a FIFO', 'a directory', ... for a stat mode; 'a regular file' otherwise."""
    return _KINDS.get(stat.S_IFMT(mode), "a regular file")


def tmp_name(name: str) -> str:
    """The temporary sibling an atomic write of ``name`` goes through."""
    return f".{name}{TMP_SUFFIX}"


@dataclass(frozen=True)
class Usage:
    """What a removal took away."""

    files: int = 0
    bytes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.files + other.files, self.bytes + other.bytes)


class Root:
    """A directory held open by a descriptor; every path below it is walked from it.

    ``path`` is only for messages: after :meth:`open`, renaming or replacing
    the directory at ``path`` changes nothing for this object.
    """

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: Path) -> Root:
        """Open ``path`` itself (links above it are the caller's choice, e.g. --target)."""
        return cls(Path(path), os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))

    @classmethod
    def open_absolute(cls, path: Path, what: str) -> Root:
        """Open an absolute ``path`` from ``/`` without following a link at any component."""
        parts = _absolute_parts(path, what)
        fd = _descend(os.open("/", _DIR_FLAGS), parts, Path("/"), what, create=False)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return cls(Path(path), fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:  # a Root that a failing run drops still gives its fd back
        try:
            self.close()
        except OSError:
            pass

    def full(self, relpath: str) -> Path:
        return self.path / relpath if relpath else self.path

    # -- walking ------------------------------------------------------------
    @contextmanager
    def directory(self, relpath: str, origin: str, create: bool = False) -> Iterator[int | None]:
        """A descriptor of the directory ``relpath`` ('' is the root); None if it is missing."""
        parts = relpath.split("/") if relpath else []
        fd = _descend(os.dup(self.fd), parts, self.path, origin, create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextmanager
    def parent(self, relpath: str, origin: str, create: bool = False):
        """(descriptor of the parent directory or None, last component) of ``relpath``."""
        head, _, name = relpath.rpartition("/")
        with self.directory(head, origin, create) as fd:
            yield fd, name

    def lstat(self, relpath: str, origin: str) -> os.stat_result | None:
        """The entry itself (never what a link points to); None when it is missing."""
        with self.parent(relpath, origin) as (fd, name):
            return None if fd is None else _lstat_at(fd, name)

    # -- files --------------------------------------------------------------
    def read(self, relpath: str, origin: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """A regular file's bytes; None when it is missing. Links and FIFOs are refused, and
        so is a file of more than ``limit`` bytes (:class:`TooLarge`), before it is read."""
        with self.parent(relpath, origin) as (fd, name):
            return None if fd is None else _read_at(fd, name, self.full(relpath), limit)

    def write(self, relpath: str, data: bytes, origin: str) -> None:
        """Replace ``relpath`` atomically (temporary file, fsync, renameat, fsync the directory).

        The file keeps the permission bits of the one it replaces, so a
        patched module keeps the mode pip gave it. Missing directories are
        created. The temporary file is made fresh (O_EXCL | O_NOFOLLOW).
        """
        with self.parent(relpath, origin, create=True) as (fd, name):
            existing = _lstat_at(fd, name)
            if existing is not None and not stat.S_ISREG(existing.st_mode):
                raise _not_a_file(self.full(relpath), existing.st_mode, fd, name)
            tmp = tmp_name(name)
            _unlink_at(fd, tmp)
            try:
                out = os.open(tmp, _CREATE_FLAGS, 0o644, dir_fd=fd)
                try:
                    _write_all(out, data)
                    if existing is not None:
                        os.fchmod(out, stat.S_IMODE(existing.st_mode))
                    os.fsync(out)
                finally:
                    os.close(out)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                _unlink_at(fd, tmp)
                raise
            os.fsync(fd)

    def unlink(self, relpath: str, origin: str) -> bool:
        """Remove a regular file; False when it was not there. Directories are refused."""
        with self.parent(relpath, origin) as (fd, name):
            if fd is None:
                return False
            found = _lstat_at(fd, name)
            if found is None:
                return False
            if stat.S_ISDIR(found.st_mode):
                raise _not_a_file(self.full(relpath), found.st_mode, fd, name)
            removed = _unlink_at(fd, name)
            if removed:
                os.fsync(fd)
            return removed

    def unlink_tmp(self, relpath: str, origin: str) -> None:
        """Remove the temporary sibling a killed atomic write of ``relpath`` may have left."""
        with self.parent(relpath, origin) as (fd, name):
            if fd is not None:
                _unlink_at(fd, tmp_name(name))

    def rmdir(self, relpath: str, origin: str) -> bool:
        """Remove an empty directory; False when it is missing or not empty."""
        with self.parent(relpath, origin) as (fd, name):
            if fd is None:
                return False
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                return False
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                    return False
                raise
            return True

    def names(self, relpath: str, origin: str) -> list[str]:
        """The entries of a directory (empty when it is missing)."""
        with self.directory(relpath, origin) as fd:
            return [] if fd is None else sorted(os.listdir(fd))

    def remove_tree(self, relpath: str, origin: str) -> Usage:
        """Remove ``relpath`` and everything below it, on this mount, without following links."""
        with self.parent(relpath, origin) as (fd, name):
            if fd is None or _lstat_at(fd, name) is None:
                return Usage()
            return remove_entry(fd, name, mount_id(fd), self.full(relpath))

    def mount_point_at_or_below(self, relpath: str, origin: str) -> str | None:
        """``relpath`` or the first entry below it on another mount than the root; or None."""
        found = self.lstat(relpath, origin)
        if found is None or not stat.S_ISDIR(found.st_mode):
            return None
        with self.directory(relpath, origin) as fd:
            if mount_id(fd) != mount_id(self.fd):
                return str(self.full(relpath))
            return mount_points_below(fd, self.full(relpath))

    def links_below(self, relpath: str, origin: str) -> UnsafePath | None:
        """The first symbolic link at or below ``relpath``, as the error that refuses it;
        None if there is none."""
        found = self.lstat(relpath, origin)
        if found is None:
            return None
        if stat.S_ISLNK(found.st_mode):
            return _link(self.full(relpath), self._readlink(relpath, origin))
        if not stat.S_ISDIR(found.st_mode):
            return None
        with self.directory(relpath, origin) as fd:
            return _first_link(fd, self.full(relpath))

    def _readlink(self, relpath: str, origin: str) -> str:
        with self.parent(relpath, origin) as (fd, name):
            return os.readlink(name, dir_fd=fd)


def _absolute_parts(path: Path, what: str) -> list[str]:
    text = str(path)
    if not text.startswith("/") or "\x00" in text:
        raise UnsafePath(f"{what}: {text!r} is not an absolute path", path=text, origin=what)
    parts = [p for p in text.split("/")[1:] if p]
    if any(p in (".", "..") for p in parts):
        raise UnsafePath(f"{what}: {text!r} has '.' or '..' in it", path=text, origin=what)
    return parts


def _descend(fd: int, parts: list[str], base: Path, origin: str, create: bool) -> int | None:
    """Walk ``parts`` down from ``fd`` (which this takes over); None when one is missing."""
    here = base
    for part in parts:
        here = here / part
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                return None
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                raise _walk_error(exc, here, fd, part, origin) from None
        except OSError as exc:
            error = _walk_error(exc, here, fd, part, origin)
            os.close(fd)
            raise error from None
        os.close(fd)
        fd = child
    return fd


def _walk_error(exc: OSError, path: Path, fd: int, name: str, origin: str) -> Exception:
    """A component that is a link or not a directory gets its own message; others stay OSError."""
    if exc.errno == errno.ELOOP:
        return _link(path, _readlink_or(fd, name))
    if exc.errno == errno.ENOTDIR:
        found = _lstat_at(fd, name)
        if found is not None and stat.S_ISLNK(found.st_mode):
            return _link(path, _readlink_or(fd, name))
        if found is not None and stat.S_ISDIR(found.st_mode):
            return UnsafePath(
                f"{origin}: {path} changed while patchkit walked it (it was not a directory, "
                "now it is); something else is changing the tree: stop it and run the command "
                "again",
                path=path,
                origin=origin,
                kind="a directory",
            )
        kind = kind_of(found.st_mode) if found else "gone"
        return UnsafePath(
            f"{origin}: {path} is {kind}, not a directory", path=path, origin=origin, kind=kind
        )
    return exc


def _link(path: Path, target: str) -> UnsafePath:
    return UnsafePath(
        f"{path} is a symbolic link (to {target}); patchkit never reads, writes or replaces "
        "anything through a link; point it at the real files, or remove the link",
        path=path,
        kind="a symbolic link",
        target=target,
    )


def _readlink_or(fd: int, name: str) -> str:
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return "?"


def _lstat_at(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _not_a_file(path: Path, mode: int, fd: int, name: str) -> UnsafePath:
    if stat.S_ISLNK(mode):
        return _link(path, _readlink_or(fd, name))
    return UnsafePath(
        f"{path} is {kind_of(mode)}, not a regular file; patchkit reads and writes only "
        "regular files there; remove it (reinstall vLLM if it belongs to vLLM)",
        path=path,
        kind=kind_of(mode),
    )


def _read_at(fd: int, name: str, path: Path, limit: int | None = None) -> bytes | None:
    """Read a regular file relative to ``fd``; refuse any other type before opening it,
    and (``limit``) a file larger than ``limit`` bytes before reading it or as it grows."""
    found = _lstat_at(fd, name)
    if found is None:
        return None
    if not stat.S_ISREG(found.st_mode):
        raise _not_a_file(path, found.st_mode, fd, name)
    try:
        handle = os.open(name, _READ_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            again = _lstat_at(fd, name)
            raise _not_a_file(path, again.st_mode if again else 0, fd, name) from None
        raise
    try:
        opened = os.fstat(handle)
        if not stat.S_ISREG(opened.st_mode):  # swapped between the lstat and the open
            raise _not_a_file(path, opened.st_mode, fd, name)
        if limit is not None and opened.st_size > limit:
            raise TooLarge(path, limit)
        chunks, size = [], 0
        while chunk := os.read(handle, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:  # it grew after the fstat
                raise TooLarge(path, limit)
        return b"".join(chunks)
    finally:
        os.close(handle)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _unlink_at(fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def _children(fd: int, path: Path):
    """(name, lstat, full path) of each entry of directory ``fd``, links not followed."""
    for name in sorted(os.listdir(fd)):
        found = _lstat_at(fd, name)
        if found is not None:
            yield name, found, path / name


@contextmanager
def _opened_dir(fd: int, name: str):
    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    try:
        yield child
    finally:
        os.close(child)


def _first_link(fd: int, path: Path, depth: int = 0) -> UnsafePath | None:
    for name, found, full in _children(fd, path):
        if stat.S_ISLNK(found.st_mode):
            return _link(full, _readlink_or(fd, name))
        if stat.S_ISDIR(found.st_mode):
            if depth >= MAX_DEPTH:
                return _too_deep(full)
            with _opened_dir(fd, name) as child:
                inner = _first_link(child, full, depth + 1)
            if inner:
                return inner
    return None


def _too_deep(path: Path) -> UnsafePath:
    return UnsafePath(
        f"{path} is more than {MAX_DEPTH} directories deep; patchkit never walks that far "
        "down (nothing it writes is): remove it",
        path=path,
        kind="too deep",
    )


def remove_entry(fd: int, name: str, mount: object, path: Path, depth: int = 0) -> Usage:
    """Remove ``name`` in directory ``fd``, recursively, without leaving ``mount``.

    Links are removed as links (never followed). A directory on another mount
    (a bind mount, even of the same file system) is never entered: that is an
    error, raised before anything below it is touched.
    """
    found = _lstat_at(fd, name)
    if found is None:
        return Usage()
    if not stat.S_ISDIR(found.st_mode):
        _unlink_at(fd, name)
        return Usage(1, found.st_size)
    if depth > MAX_DEPTH:
        raise _too_deep(path)
    with _opened_dir(fd, name) as child:
        if mount_id(child) != mount:
            raise UnsafePath(
                f"{path} is a mount point; patchkit never removes across mounts",
                path=path,
                kind="a mount point",
            )
        usage = Usage()
        for inner in sorted(os.listdir(child)):
            usage = usage + remove_entry(child, inner, mount, path / inner, depth + 1)
    os.rmdir(name, dir_fd=fd)
    return usage


def mount_points_below(fd: int, path: Path, depth: int = 0) -> str | None:
    """The first entry below ``fd`` that is on another mount (a bind-mounted directory or
    file); None if there is none."""
    if depth > MAX_DEPTH:
        raise _too_deep(path)
    mount = mount_id(fd)
    for name, found, full in _children(fd, path):
        if stat.S_ISLNK(found.st_mode):
            continue
        if not stat.S_ISDIR(found.st_mode):
            entry = _entry_mount(fd, name)
            if entry is not _GONE and entry != mount:
                return str(full)
            continue
        with _opened_dir(fd, name) as child:
            below = mount_id(child) == mount
            inner = mount_points_below(child, full, depth + 1) if below else str(full)
        if inner:
            return inner
    return None


_GONE = object()


def _entry_mount(fd: int, name: str) -> object:
    """The mount of a non-directory entry, opened with O_PATH (never read, never followed).

    _GONE when the entry vanished after it was listed (another run's temporary file
    renamed into place): nothing is there, so nothing is mounted there; any other
    error still counts as a mount of its own."""
    try:
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except FileNotFoundError:
        return _GONE
    except OSError:
        return None
    try:
        return mount_id(handle)
    finally:
        os.close(handle)


_STATX_MNT_ID = 0x1000
_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100


def mount_id(fd: int) -> object:
    """Which mount a directory descriptor is on (statx's mount id; st_dev where there is none).

    A bind mount of a directory of the same file system has the same st_dev
    as its parent, so only the mount id tells it apart.
    """
    statx = _statx()
    if statx is not None:
        buffer = ctypes.create_string_buffer(256)
        flags = _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW
        if statx(fd, b"", flags, _STATX_MNT_ID, buffer) == 0:
            mask = int.from_bytes(buffer.raw[0:4], "little")
            if mask & _STATX_MNT_ID:
                return ("mnt", int.from_bytes(buffer.raw[144:152], "little"))
    return ("dev", os.fstat(fd).st_dev)


_STATX_FUNCTION: list = []


def _statx():
    if not _STATX_FUNCTION:
        try:
            function = ctypes.CDLL(None, use_errno=True).statx
            function.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_uint,
                ctypes.c_char_p,
            ]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):
            function = None
        _STATX_FUNCTION.append(function)
    return _STATX_FUNCTION[0]
