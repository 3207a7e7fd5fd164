"""All-or-nothing writes to a vLLM tree.

A run that changes files goes through :func:`commit`:

1. the original of every file is copied to ``.patchkit/txn/orig/`` and the
   journal (``txn/journal.json``: each file's sha256 before and after, the
   patches that change it, and the sha256 of the state file the run will
   write) is written atomically;
2. each file is written through a temporary file and ``renameat``;
3. the state file is written atomically (this is the commit point);
4. ``txn/`` is removed.

If a step fails inside the process, the files already written are restored
from memory before the error is reported. Ctrl-C and SIGTERM are held while
the run holds the lock (:mod:`patchkit.signals`), so they never fall between
a write and the state entry of it. If the process dies (kill -9, power loss), the
journal stays behind and the next ``apply``, ``revert`` or ``refresh`` calls
:func:`recover` first: before the commit point it restores the originals,
after it only removes the journal. A journal entry is acted on only when a
diff of the patches it names creates, changes or deletes that file.

:class:`TreeLock` (``fcntl.flock`` on ``.patchkit/lock``) keeps two runs on
the same tree from interleaving; a second run waits for the first.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass

from patchkit.codes import Code, Reason
from patchkit.errors import OsFailure, PatchkitError, Refused, cause_of
from patchkit.fs import locks
from patchkit.fs.safepath import Root, UnsafePath, checked_relpath
from patchkit.identity import sha256_bytes
from patchkit.patching.state import (
    MAX_JSON_BYTES,
    STATE_DIR,
    STATE_FILE,
    TXN_DIR,
    State,
    check_no_links,
    file_sha256,
    is_sha256,
    load_json,
)
from patchkit.signals import held

LOCK_FILE = f"{STATE_DIR}/lock"
JOURNAL = f"{TXN_DIR}/journal.json"
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass(frozen=True)
class FileChange:
    """One file's content before and after (None: absent), and the patches that change it."""

    path: str  # relative to the tree root
    before: bytes | None
    after: bytes | None
    patches: tuple[str, ...] = ()


class LockUnavailable(PatchkitError):
    """The lock file cannot be created: a read-only or foreign-owned tree (``path``: the
    lock; ``error``: the system's words).

    A run that would write nothing can still succeed on such a tree.
    """

    code = Code.LOCK_UNAVAILABLE


def _lock_failure(fs: Root, number: int, words: str) -> OsFailure:
    """Creating the lock failed with ``number``: the words name the lock's full path (the
    open is relative to a directory)."""
    return OsFailure(OSError(number, words, str(fs.full(LOCK_FILE))), "creating the lock")


def lock_unavailable(fs: Root) -> LockUnavailable | None:
    """What :class:`TreeLock` would meet on a read-only or foreign-owned tree, found
    without creating anything, so ``--dry-run`` ends as the run would; None where it could
    make its lock.

    The lock opens ``.patchkit/lock`` for writing, creating it (and ``.patchkit/``) where
    missing: the place it would create in, or the lock it would open, is checked for
    writing as this process (``faccessat`` with its effective ids: a read-only mount,
    permission bits, an immutable file), and the file system's read-only flag tells
    EROFS from EACCES, the errors the lock takes as unwritable.
    """
    check_no_links(fs)
    if fs.lstat(STATE_DIR, "lock") is None:
        where, name, mode = "", ".", os.W_OK | os.X_OK
    elif _lock_file(fs) is None:
        where, name, mode = STATE_DIR, ".", os.W_OK | os.X_OK
    else:
        where, name, mode = STATE_DIR, "lock", os.R_OK | os.W_OK
    with fs.directory(where, "lock") as fd:
        if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            number = errno.EROFS
        elif not os.access(name, mode, dir_fd=fd, effective_ids=True):
            number = errno.EACCES
        else:
            return None
    failure = _lock_failure(fs, number, os.strerror(number))
    return LockUnavailable(str(failure), path=fs.full(LOCK_FILE), error=os.strerror(number))


def _lock_file(fs: Root) -> os.stat_result | None:
    """The lock file's lstat, None where there is none; UnsafePath where it is no regular
    file (refused by type before it is opened, by the lock and by the dry run's forecast
    alike: a directory or a FIFO there made --dry-run say '4 would apply')."""
    found = fs.lstat(LOCK_FILE, "lock")
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise UnsafePath(f"{fs.full(LOCK_FILE)} is not a regular file; remove it")
    return found


class TreeLock:
    """An exclusive lock on one tree, waited for as :mod:`patchkit.fs.locks` says."""

    def __init__(self, fs: Root):
        self.fs = fs
        self.timeout = locks.lock_timeout()
        self._fd = -1
        self._made: list[str] = []  # lock file and directory this lock made: undone on failure

    @property
    def path(self):
        return self.fs.full(LOCK_FILE)

    def _open(self) -> None:
        check_no_links(self.fs)
        try:
            if self.fs.lstat(STATE_DIR, "lock") is None:
                self._made.append(STATE_DIR)
            if _lock_file(self.fs) is None:
                self._made.insert(0, LOCK_FILE)
            with self.fs.directory(STATE_DIR, "lock", create=True) as directory:
                fd = os.open(
                    "lock",
                    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    0o644,
                    dir_fd=directory,
                )
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafePath(f"{self.path} is not a regular file; remove it")
            self._fd = fd
        except OSError as exc:
            self._undo_created()
            if exc.errno == errno.ELOOP:
                raise UnsafePath(f"{self.path} is a symbolic link; remove it") from None
            failure = _lock_failure(self.fs, exc.errno, exc.strerror)
            if exc.errno in _UNWRITABLE:
                raise LockUnavailable(str(failure), path=self.path, error=exc.strerror) from None
            raise Refused(Reason.of(Code.LOCK_NOT_CREATED, cause=failure.reason)) from None

    def __enter__(self) -> TreeLock:
        """Create and lock; signals are held while anything is made, not while waiting."""
        try:
            with held():
                self._open()
            busy = Reason.of(Code.LOCK_BUSY, path=str(self.path), waited=self.timeout)
            locks.wait_for(self._try_lock, self.timeout, busy)
        except BaseException:
            with held():
                self._close()
                self._undo_created()
            raise
        return self

    def _try_lock(self) -> bool:
        with held():
            if not locks.try_flock(self._fd):
                return False
            if self._still_linked():
                return True
            # The holder before us removed the lock file (tidy); lock the new one.
            self._close()
            self._open()
            return False

    def _still_linked(self) -> bool:
        found = self.fs.lstat(LOCK_FILE, "lock")
        return found is not None and found.st_ino == os.fstat(self._fd).st_ino

    def unlink_file(self) -> None:
        """Unlink the lock file while still holding it (the tree's .patchkit/ is going away)."""
        self.fs.unlink(LOCK_FILE, "lock")

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None:  # a failed run leaves no lock file or directory it made
            with held():
                self._undo_created()
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing releases the flock
            self._fd = -1

    def _undo_created(self) -> None:
        """Remove the lock file and ``.patchkit/`` (if empty) that this lock made.

        Best effort: on a read-only tree nothing was made, and an error here
        must not hide the one that ended the run.
        """
        made, self._made = self._made, []
        for relpath in made:
            try:
                if relpath == LOCK_FILE:
                    self.fs.unlink(LOCK_FILE, "lock")
                elif self.fs.lstat(relpath, "lock") is not None:
                    self.fs.rmdir(relpath, "lock")  # only if empty
            except OSError:
                pass


def interrupted(fs: Root) -> bool:
    """True when an earlier run died while writing (its journal is still there)."""
    return fs.lstat(JOURNAL, "journal") is not None


def commit(state: State, changes: list[FileChange], backups: dict[str, bytes]) -> None:
    """Write ``backups`` (paths relative to ``.patchkit/``), then ``changes``, then ``state``.

    All or nothing: on any failure (a full disk, a permission error, a file
    changed under the run) the files already written are restored, this
    run's backups and journal are removed, and the tree is as before. If even
    the restore fails, the journal stays and the next run rolls back.
    """
    written: list[FileChange] = []
    try:
        commit_or_undo(state, changes, backups, written)
    except OSError as exc:
        why = cause_of(exc, "writing")
        raise Refused(Reason.of(Code.WRITE_UNDONE, cause=why, written=len(written))) from None
    state.fs.remove_tree(TXN_DIR, "journal")


def commit_or_undo(
    state: State,
    changes: list[FileChange],
    backups: dict[str, bytes],
    written: list[FileChange] | None = None,
) -> None:
    """:func:`commit` up to and with the state file, for a caller with writes of its own.

    On failure the tree is put back and the error raised as it came (the
    caller puts its own files back and words the message); ``written`` says
    how many tree files had been written. The journal is left for the caller
    to remove once it has finished (the next run removes it otherwise).
    """
    fs = state.fs
    new_state = state.to_bytes()
    old_state = fs.read(STATE_FILE, "state")
    stored: list[str] = []
    written = [] if written is None else written
    try:
        fs.remove_tree(TXN_DIR, "journal")  # leftovers of a run that died before its journal
        for change in changes:
            if change.before is not None:
                _store(fs, f"{TXN_DIR}/orig/{change.path}", change.before, stored)
        for relpath, data in backups.items():
            _store(fs, f"{STATE_DIR}/{relpath}", data, stored)
        _store(fs, JOURNAL, _journal(changes, new_state), stored)
        for change in changes:
            _expect(fs, change)
            written.append(change)  # recorded first: an undo of an unwritten file is a no-op
            _write(fs, change.path, change.after)
        fs.write(STATE_FILE, new_state, "state")
    except BaseException:
        _undo(fs, written, stored)
        _restore_state(fs, old_state, new_state)
        raise


def _restore_state(fs: Root, old: bytes | None, new: bytes) -> None:
    """The state file as it was, when the failure came after its rename (the directory's
    fsync): the tree is back, so its state must be too, or status would describe a
    patch that is not there. Best effort: an error here must not hide the first one."""
    try:
        if fs.read(STATE_FILE, "rollback") != new or old == new:
            return
        if old is None:
            fs.unlink(STATE_FILE, "rollback")
        else:
            fs.write(STATE_FILE, old, "rollback")
    except OSError:
        pass


def _expect(fs: Root, change: FileChange) -> None:
    """The file must still be what the run assessed; someone else may have written it since."""
    current = fs.read(change.path, "apply")
    if file_sha256(current) != file_sha256(change.before):
        raise Refused(Reason.of(Code.CHANGED_WHILE_RUNNING, path=str(fs.full(change.path))))


def _store(fs: Root, relpath: str, data: bytes, stored: list[str]) -> None:
    """Write one of patchkit's own files under ``.patchkit/`` and remember it for undo."""
    checked_relpath(relpath, str(fs.full(STATE_DIR)), top=STATE_DIR)
    stored.append(relpath)
    fs.write(relpath, data, "state")


def _journal(changes: list[FileChange], new_state: bytes) -> bytes:
    journal = {
        "state_sha256": sha256_bytes(new_state),
        "files": [
            {
                "path": c.path,
                "before": file_sha256(c.before),
                "after": file_sha256(c.after),
                "patches": list(c.patches),
            }
            for c in changes
        ],
    }
    return json.dumps(journal, indent=2).encode()


def _undo(fs: Root, written: list[FileChange], stored: list[str]) -> None:
    """Put the tree back after a failed commit; keep the journal if that fails."""
    try:
        for change in reversed(written):
            fs.unlink_tmp(change.path, "rollback")
            _write(fs, change.path, change.before)
    except BaseException as exc:
        raise Refused(Reason.of(Code.RESTORE_FAILED, cause=cause_of(exc, "restoring"))) from None
    for relpath in stored:
        fs.unlink(relpath, "rollback")
        fs.unlink_tmp(relpath, "rollback")
        _remove_empty_parents(fs, relpath)
    fs.remove_tree(TXN_DIR, "rollback")


def _remove_empty_parents(fs: Root, relpath: str) -> None:
    """The folders a stored backup made under .patchkit/, once empty (a failed first
    apply leaves no .patchkit/backups/<id>/ behind)."""
    parts = relpath.split("/")[:-1]
    while len(parts) > 1 and fs.rmdir("/".join(parts), "rollback"):
        parts.pop()


def _write(fs: Root, relpath: str, data: bytes | None) -> None:
    if data is None:
        fs.unlink(relpath, "apply")
    else:
        fs.write(relpath, data, "apply")


@dataclass(frozen=True)
class _JournalEntry:
    path: str
    before: str | None
    after: str | None


def _read_journal(
    fs: Root, file_kinds, reinstall: dict[str, str]
) -> tuple[str, list[_JournalEntry]]:
    """The journal, validated like the state file and against the diffs of its patches;
    refused naming ``reinstall`` (the tree's command, VllmTree.reinstall_facts) as the way
    on."""
    path = fs.full(JOURNAL)
    try:
        data = load_json(fs, JOURNAL, "journal")
        if not isinstance(data, dict) or set(data) != {"state_sha256", "files"}:
            raise ValueError("wrong keys")
        if not isinstance(data["files"], list):
            raise ValueError("files is not a list")
        entries = [_journal_entry(raw, str(path), file_kinds) for raw in data["files"]]
        if len({entry.path for entry in entries}) != len(entries):
            raise ValueError("a file is listed twice (patchkit writes each file once)")
        if not is_sha256(data["state_sha256"]):
            raise ValueError("state_sha256 is not a sha256")
    except (ValueError, TypeError, UnsafePath) as exc:
        raise Refused(
            Reason.of(
                Code.INVALID_JOURNAL,
                path=str(path),
                why=str(exc),
                journal=str(path.parent),
                **reinstall,
            )
        ) from None
    return data["state_sha256"], entries


def _journal_entry(raw: object, origin: str, file_kinds) -> _JournalEntry:
    keys = {"path", "before", "after", "patches"}
    if not isinstance(raw, dict) or set(raw) != keys or not isinstance(raw["patches"], list):
        raise ValueError("a file entry is malformed")
    path = checked_relpath(raw["path"], origin)
    for key in ("before", "after"):
        if raw[key] is not None and not is_sha256(raw[key]):
            raise ValueError(f"{path}: {key} is not a sha256")
    kinds: set[str] = set()
    for patch_id in raw["patches"]:
        known = file_kinds(patch_id) if isinstance(patch_id, str) else None
        if known is None:
            raise ValueError(f"{path}: names {str(patch_id)[:40]!r}, a patch this patchkit lacks")
        kinds |= known.get(path, set())
    if not kinds:
        raise ValueError(f"{path}: no diff of the patches it names touches that file")
    if None in (raw["before"], raw["after"]) and not kinds & {"creates", "deletes"}:
        raise ValueError(f"{path}: absent before or after, but no diff creates or deletes it")
    return _JournalEntry(path, raw["before"], raw["after"])


def recover(fs: Root, file_kinds, reinstall: dict[str, str]) -> list[Reason]:
    """Finish or undo a run that died mid-write; returns what was done. A journal it may
    not act on is refused naming ``reinstall``, the tree's own reinstall command
    (VllmTree.reinstall_facts): the files are then vLLM's own again."""
    if not interrupted(fs):
        if fs.lstat(TXN_DIR, "journal") is not None:  # died before its journal: untouched
            fs.remove_tree(TXN_DIR, "journal")
        return []
    state_sha, entries = _read_journal(fs, file_kinds, reinstall)
    for entry in entries:
        fs.unlink_tmp(entry.path, "rollback")
    if file_sha256(fs.read(STATE_FILE, "state", MAX_JSON_BYTES)) == state_sha:
        fs.remove_tree(TXN_DIR, "journal")
        return [Reason.of(Code.ROLLED_BACK_COMMITTED)]
    restored = []
    for entry in entries:
        current = file_sha256(fs.read(entry.path, "rollback"))
        if current == entry.before:
            continue
        if current != entry.after:
            raise Refused(
                Reason.of(
                    Code.CHANGED_SINCE_INTERRUPTED,
                    path=str(fs.full(entry.path)),
                    journal=str(fs.full(TXN_DIR)),
                    **reinstall,
                )
            )
        if entry.before is None:
            fs.unlink(entry.path, "rollback")
        else:
            original = fs.read(f"{TXN_DIR}/orig/{entry.path}", "journal")
            if original is None or sha256_bytes(original) != entry.before:
                raise Refused(
                    Reason.of(
                        Code.JOURNAL_COPY_DAMAGED,
                        path=entry.path,
                        journal=str(fs.full(TXN_DIR)),
                        **reinstall,
                    )
                )
            fs.write(entry.path, original, "rollback")
        restored.append(entry.path)
    fs.remove_tree(TXN_DIR, "journal")
    return [Reason.of(Code.ROLLED_BACK, path=p) for p in restored] or [
        Reason.of(Code.ROLLED_BACK_NOTHING)
    ]


def after_recovery(exc: OSError | PatchkitError, done: list[Reason], doing: str) -> Refused:
    """The error of a run that first rolled an interrupted run back (``done``, what that
    did): the roll-back changed the tree and stands, so the words say so ("nothing else
    was changed"). ``doing`` names what an OSError interrupted ("accessing", "reading")."""
    return Refused(Reason.of(Code.REFUSED_AFTER_RECOVERY, cause=cause_of(exc, doing), done=done))
