"""All-or-nothing writes into the catalogue, with the tree's state, for ``patchkit refresh``.

refresh rewrites a variant's diff and created files under ``patches/`` and
the state entry of the same patch in the tree (``.patchkit/state.json``). Both
land or neither does, whatever kills the process:

1. each new file, and each file it replaces, is copied into
   ``patches/.patchkit-refresh/`` (``new/`` and ``old/``, on the catalogue's
   own file system, modes kept);
2. the journal (``journal.json``: each file's sha256 before and after, the
   tree, and the sha256 of the state file the run will write) is written
   atomically;
3. the new files are renamed into place;
4. the tree's state file is written (the tree's own transaction): the commit
   point;
5. ``.patchkit-refresh/`` is removed.

Only refresh, the command that owns the journal, acts on one a killed run
left (:func:`recover`): every ``patchkit refresh`` first, and ``patchkit
refresh --recover`` alone, and each says what it did. It decides by the
tree's state file: the journal's sha256, and the run committed, so the new
files go into place; anything else, and the old ones come back. Every other
command only notices the journal (:func:`pending`, one ``lstat``) and never
writes: reading the catalogue never changes it. Nothing else is ever
written there: no temporary file stays in ``patches/``. The journal is
hostile input like the tree's: it may name only a diff (``<id>/<name>.diff``)
or a created file (``<id>/files/vllm/...``) of a patch in the series,
reached by descriptor walks that never follow a link; the tree is only read;
and no file is read past its bound (the journal 1 MiB, each catalogue file
and the tree's state 16 MiB), so a huge staged file is refused, not read
whole. The catalogue directory itself is locked (``flock``, waited for as
:mod:`patchkit.fs.locks` says) while a run writes or recovers.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, Refused, os_error_line
from patchkit.fs import locks
from patchkit.fs.files import decode_json
from patchkit.fs.safepath import Root, TooLarge, UnsafePath, checked_relpath
from patchkit.identity import sha256_bytes
from patchkit.signals import held

JOURNAL_DIR = ".patchkit-refresh"
JOURNAL = f"{JOURNAL_DIR}/journal.json"
TREE_STATE = ".patchkit/state.json"  # patching.state.STATE_FILE, read here (a lower layer)
MAX_JOURNAL_BYTES = 1 << 20
MAX_FILE_BYTES = 16 << 20  # a diff or a created file (the largest is 70 kB); the tree's state
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class CatalogueFile:
    """One file refresh writes, relative to the catalogue root; ``before`` None: new."""

    path: str
    before: bytes | None
    after: bytes
    mode: int | None = None  # the permission bits of the file it replaces, kept


def catalogue_path(relpath: object, ids: Iterable[str], origin: str) -> str:
    """``relpath`` if refresh may write it: a diff or a created file of a patch in ``ids``."""
    path = checked_relpath(relpath, origin, top=None)
    parts = path.split("/")
    is_diff = len(parts) == 2 and parts[1].endswith(".diff")
    is_created = len(parts) >= 4 and parts[1:3] == ["files", "vllm"]
    if parts[0] not in set(ids) or not (is_diff or is_created):
        raise UnsafePath(
            f"{origin}: {path!r} is neither <id>/<name>.diff nor <id>/files/vllm/... of a "
            "patch in the series"
        )
    return path


class CatalogueLock:
    """An exclusive ``flock`` on the catalogue directory, waited for like the tree's lock
    (:mod:`patchkit.fs.locks`: one rule, one reading of PATCHKIT_LOCK_TIMEOUT)."""

    def __init__(self, fs: Root):
        self.fs = fs
        self.timeout = locks.lock_timeout()

    def __enter__(self) -> Root:
        busy = Reason.of(Code.CATALOGUE_BUSY, path=str(self.fs.path), waited=self.timeout)
        locks.wait_for(lambda: locks.try_flock(self.fs.fd), self.timeout, busy)
        return self.fs

    def __exit__(self, *exc_info) -> None:
        locks.release(self.fs.fd)


def tree_path(fs: Root) -> str:
    """The tree's absolute path without links, checked to lead to the directory ``fs`` holds.

    The journal names the tree by it; recovery opens it from ``/`` without
    following a link (:meth:`Root.open_absolute`), so it must be exact now.
    """
    try:
        path = os.readlink(f"/proc/self/fd/{fs.fd}")
    except OSError:
        path = os.path.realpath(fs.path)
    try:
        with Root.open_absolute(Path(path), "the tree") as again:
            same = _same_directory(again.fd, fs.fd)
    except (OSError, UnsafePath):
        same = False
    if not same:
        raise Refused(Reason.of(Code.JOURNAL_TREE_NOT_REAL, tree=str(fs.path), real=path))
    return path


def _same_directory(a: int, b: int) -> bool:
    first, second = os.fstat(a), os.fstat(b)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


class CatalogueWrite:
    """One refresh's files: staged and journaled, installed, then undone or finished.

    The caller holds :class:`CatalogueLock` and the tree's lock, with signals
    held, and writes the tree's state file between :meth:`install` and
    :meth:`finish`; ``state_after`` is the sha256 that file will have.
    """

    def __init__(self, fs: Root, files: list[CatalogueFile], tree: str, state_after: str):
        self.fs = fs
        self.files = files
        self.tree = tree
        self.state_after = state_after
        self.installed: list[CatalogueFile] = []

    def prepare(self) -> None:
        """Stage every new and old file, then write the journal (nothing in place yet).

        A file past MAX_FILE_BYTES is refused first: recovery would refuse to read it."""
        for item in self.files:
            if max(len(item.after), len(item.before or b"")) > MAX_FILE_BYTES:
                path = str(self.fs.full(item.path))
                raise Refused(
                    Reason.of(Code.CATALOGUE_FILE_TOO_LARGE, path=path, most=MAX_FILE_BYTES)
                )
        self.fs.remove_tree(JOURNAL_DIR, "journal")  # a run that died before its journal
        for item in self.files:
            _stage(self.fs, f"{JOURNAL_DIR}/new/{item.path}", item.after, item.mode)
            if item.before is not None:
                _stage(self.fs, f"{JOURNAL_DIR}/old/{item.path}", item.before, item.mode)
        self.fs.write(JOURNAL, self._journal(), "journal")

    def _journal(self) -> bytes:
        entries = [
            {"path": f.path, "before": _sha(f.before), "after": _sha(f.after)} for f in self.files
        ]
        data = {"tree": self.tree, "state_after": self.state_after, "files": entries}
        return json.dumps(data, indent=2).encode()

    def install(self) -> None:
        """Rename each staged new file into place (recorded first: undoing a no-op is safe)."""
        for item in self.files:
            self.installed.append(item)
            _move(self.fs, f"{JOURNAL_DIR}/new/{item.path}", item.path)

    def committed(self) -> bool:
        """Whether the tree's state file is the one this run writes (its commit point)."""
        return _tree_record_sha(self.tree) == self.state_after

    def undo(self) -> int:
        """Put back every file installed so far and drop the staging; how many came back.

        If that fails the journal stays, and the next refresh (or `refresh --recover`)
        rolls the run back from it.
        """
        restored = len(self.installed)
        try:
            for item in reversed(self.installed):
                _restore(self.fs, item.path, item.before is not None)
            self.installed = []
            self.fs.remove_tree(JOURNAL_DIR, "rollback")
        except BaseException as exc:
            journal = str(self.fs.full(JOURNAL))
            raise Refused(
                Reason.of(Code.CATALOGUE_UNDO_FAILED, error=str(exc), journal=journal)
            ) from None
        return restored

    def finish(self) -> None:
        """Remove the staging after the commit point (what is left, the next refresh removes)."""
        self.fs.remove_tree(JOURNAL_DIR, "journal")


def _stage(fs: Root, relpath: str, data: bytes, mode: int | None) -> None:
    """Write a fresh staged copy (never through a link), with the mode of the file it stands for."""
    with fs.parent(relpath, "journal", create=True) as (fd, name):
        out = os.open(name, _CREATE, 0o644, dir_fd=fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
            if mode is not None:
                os.fchmod(out, mode)
            os.fsync(out)
        finally:
            os.close(out)
        os.fsync(fd)


def _move(fs: Root, source: str, target: str) -> None:
    """renameat from the staging into place; the target, if any, must be a regular file."""
    found = fs.lstat(target, "refresh")
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise UnsafePath(f"{fs.full(target)} is not a regular file; refresh writes only files")
    with fs.parent(source, "journal") as (src_fd, src_name):
        with fs.parent(target, "refresh", create=True) as (dst_fd, dst_name):
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            os.fsync(dst_fd)


def _restore(fs: Root, relpath: str, existed: bool) -> None:
    """The old file back in place, or the new one removed where there was none."""
    if existed:
        _move(fs, f"{JOURNAL_DIR}/old/{relpath}", relpath)
    else:
        fs.unlink(relpath, "rollback")


def _tree_record_sha(tree: str) -> str | None:
    """sha256 of the tree's state file, read from ``/`` without following links; None: absent."""
    try:
        with Root.open_absolute(Path(tree), "the journal's tree") as fs:
            return _sha(fs.read(TREE_STATE, "the journal's tree", MAX_FILE_BYTES))
    except FileNotFoundError:
        return None  # the tree is gone: the run's state went with it


@dataclass(frozen=True)
class _Entry:
    path: str
    before: str | None
    after: str


def pending(root: Path) -> Path | None:
    """The staging a refresh that died mid-write left in the catalogue at ``root``, if any:
    one ``lstat``, no lock, nothing written (every command but refresh asks only this)."""
    try:
        with Root.open(root) as fs:
            return fs.full(JOURNAL_DIR) if fs.lstat(JOURNAL_DIR, "journal") is not None else None
    except OSError:
        return None  # no catalogue there: the load names the missing file


def recover(root: Path, ids: Iterable[str]) -> list[str]:
    """Finish or undo a refresh that died mid-write (refresh's, and only refresh's, to call);
    what it did, one line each (nothing: no line).

    Costs one ``lstat`` when there is nothing to do (a read-only, installed
    catalogue never has anything).
    """
    try:
        fs = Root.open(root)
    except OSError:
        return []  # no catalogue there: the load names the missing file
    with fs:
        if fs.lstat(JOURNAL_DIR, "journal") is None:
            return []
        try:
            with CatalogueLock(fs), held():
                return recover_locked(fs, ids)
        except OSError as exc:
            line = os_error_line(exc, "finishing an interrupted refresh in")
            journal = str(fs.full(JOURNAL))
            raise Refused(
                Reason.of(Code.CATALOGUE_RECOVERY_FAILED, error=line, journal=journal)
            ) from None


def recover_locked(fs: Root, ids: Iterable[str]) -> list[Reason]:
    """:func:`recover` for a caller that holds :class:`CatalogueLock` on ``fs``."""
    if fs.lstat(JOURNAL, "journal") is None:
        if fs.lstat(JOURNAL_DIR, "journal") is None:
            return []
        fs.remove_tree(JOURNAL_DIR, "journal")  # died before its journal: nothing in place
        return [Reason.of(Code.CATALOGUE_STAGING_REMOVED)]
    tree, state_after, entries = _read_journal(fs, ids)
    try:
        committed = _tree_record_sha(tree) == state_after
    except (OSError, PatchkitError) as exc:
        unread = Reason.of(Code.JOURNAL_TREE_UNREADABLE, tree=tree, error=str(exc))
        raise _not_acted_on(fs, unread) from None
    try:  # every file is checked before any is touched
        moves = [_move_for(fs, entry, committed) for entry in entries]
    except (UnsafePath, TooLarge) as exc:
        unsafe = Reason.of(Code.JOURNAL_UNSAFE, error=str(exc), cause=exc.reason)
        raise _not_acted_on(fs, unsafe) from None
    for entry, staged in moves:
        if staged is None:
            fs.unlink(entry.path, "rollback")
        elif staged:
            _move(fs, staged, entry.path)
    fs.remove_tree(JOURNAL_DIR, "journal")
    paths = [e.path for e in entries]
    return [Reason.of(Code.CATALOGUE_RECOVERED, finished=committed, paths=paths)]


def _move_for(fs: Root, entry: _Entry, forward: bool) -> tuple[_Entry, str | None]:
    """What leaves one file as the run left it after (``forward``) or found it before:
    the staged copy to move into place, '' for nothing, None to remove the file."""
    want, other = (entry.after, entry.before) if forward else (entry.before, entry.after)
    current = _sha(fs.read(entry.path, "journal", MAX_FILE_BYTES))
    if current == want:
        return entry, ""
    if current != other:
        raise _not_acted_on(fs, Reason.of(Code.JOURNAL_FILE_CHANGED, path=entry.path))
    if want is None:
        return entry, None
    staged = f"{JOURNAL_DIR}/{'new' if forward else 'old'}/{entry.path}"
    if _sha(fs.read(staged, "journal", MAX_FILE_BYTES)) != want:
        raise _not_acted_on(fs, Reason.of(Code.JOURNAL_COPY_MISSING, path=entry.path))
    return entry, staged


def _read_journal(fs: Root, ids: Iterable[str]) -> tuple[str, str, list[_Entry]]:
    ids = tuple(ids)
    try:
        raw = fs.read(JOURNAL, "journal", MAX_JOURNAL_BYTES)
        data = decode_json(raw or b"", MAX_JOURNAL_BYTES)
        if not isinstance(data, dict) or set(data) != {"tree", "state_after", "files"}:
            raise ValueError("wrong keys")
        if not isinstance(data["tree"], str) or not data["tree"].startswith("/"):
            raise ValueError("tree is not an absolute path")
        if not _is_sha(data["state_after"]):
            raise ValueError("state_after is not a sha256")
        if not isinstance(data["files"], list) or not data["files"]:
            raise ValueError("files is not a list of files")
        entries = [_entry(item, ids, str(fs.full(JOURNAL))) for item in data["files"]]
        if len({e.path for e in entries}) != len(entries):
            raise ValueError("a file is listed twice")
    except (ValueError, UnsafePath, TooLarge) as exc:
        raise _not_acted_on(fs, Reason.of(Code.JOURNAL_INVALID, why=str(exc))) from None
    return data["tree"], data["state_after"], entries


def _entry(item: object, ids: tuple[str, ...], origin: str) -> _Entry:
    if not isinstance(item, dict) or set(item) != {"path", "before", "after"}:
        raise ValueError("a file entry is malformed")
    path = catalogue_path(item["path"], ids, origin)
    if not (item["before"] is None or _is_sha(item["before"])) or not _is_sha(item["after"]):
        raise ValueError(f"{path}: before or after is not a sha256")
    return _Entry(path, item["before"], item["after"])


def _not_acted_on(fs: Root, problem: Reason) -> Refused:
    """The journal is left as it is: ``problem`` says why, the words what to do by hand."""
    return Refused(
        Reason.of(
            Code.JOURNAL_NOT_ACTED_ON,
            journal=str(fs.full(JOURNAL)),
            catalogue=str(fs.path),
            staging=str(fs.full(JOURNAL_DIR)),
            problem=problem,
        )
    )


def _is_sha(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _sha(data: bytes | None) -> str | None:
    return None if data is None else sha256_bytes(data)
