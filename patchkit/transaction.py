"""All-or-nothing writes to a vLLM tree.

A run that changes files goes through :func:`commit`:

1. the original of every file is copied to ``.patchkit/txn/orig/`` and the
   journal (``txn/journal.json``: each file's sha256 before and after, and the
   sha256 of the state file the run will write) is written atomically;
2. each file is written through a temporary file and ``os.replace``;
3. the state file is written atomically (this is the commit point);
4. ``txn/`` is removed.

If a step fails inside the process, the files already written are restored
from ``txn/orig`` before the error is reported. If the process dies (kill -9,
power loss), the journal stays behind and the next ``apply`` or ``revert``
calls :func:`recover` first: before the commit point it restores the
originals, after it only removes the journal.

:class:`TreeLock` (``fcntl.flock`` on ``.patchkit/lock``) keeps two runs on
the same tree from interleaving; a second run waits for the first.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from patchkit.errors import PatchkitError, os_error_line
from patchkit.fsutil import read_or_none, remove_if_present, tmp_sibling, write_atomic
from patchkit.safepath import checked_relpath, inside, no_links_below
from patchkit.state import State, is_sha256
from patchkit.tree import sha256_bytes, sha256_file

LOCK_TIMEOUT_ENV = "PATCHKIT_LOCK_TIMEOUT"
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass(frozen=True)
class FileChange:
    """One file's content before and after (None: absent)."""

    path: str  # relative to the tree root
    before: bytes | None
    after: bytes | None


class LockUnavailable(PatchkitError):
    """The lock file cannot be created: a read-only or foreign-owned tree.

    A run that would write nothing can still succeed on such a tree.
    """


class TreeLock:
    """An exclusive lock on one tree, waited for up to PATCHKIT_LOCK_TIMEOUT s (60)."""

    def __init__(self, directory: Path):
        self.path = directory / "lock"
        self.timeout = _lock_timeout()
        self._handle = None
        self._created: list[Path] = []  # what this lock made, undone if the run fails

    def _open(self) -> None:
        directory = self.path.parent
        no_links_below(directory)
        try:
            if not directory.is_dir():
                directory.mkdir()
                self._created.append(directory)
            if not os.path.lexists(self.path):
                self._created.insert(0, self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            self._handle = os.fdopen(fd, "a+")
        except OSError as exc:
            self._undo_created()
            line = os_error_line(exc, "creating the lock")
            if exc.errno in _UNWRITABLE:
                raise LockUnavailable(line) from None
            raise PatchkitError(f"{line}; nothing was changed") from None

    def __enter__(self) -> TreeLock:
        self._open()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._still_linked():
                    return self
                # The holder before us removed the lock file (tidy); lock the new one.
                self._handle.close()
                self._open()
                continue
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self._handle.close()
                    raise PatchkitError(
                        f"another patchkit run holds {self.path} (waited {self.timeout:.0f} s); "
                        "let it finish, then run the command again"
                    ) from None
                time.sleep(0.05)

    def _still_linked(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self._handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def unlink_file(self) -> None:
        """Unlink the lock file while still holding it (the tree's .patchkit/ is going away)."""
        remove_if_present(self.path)

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None:  # a failed run leaves no lock file or directory it made
            self._undo_created()
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()

    def _undo_created(self) -> None:
        for path in self._created:
            if path == self.path:
                remove_if_present(path)
            else:
                _rmdir_if_empty(path)
        self._created = []


def _lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "60")
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise PatchkitError(f"{LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def _rmdir_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


def _txn_dir(state: State) -> Path:
    return state.directory / "txn"


def interrupted(state: State) -> bool:
    """True when an earlier run died while writing (its journal is still there)."""
    return (_txn_dir(state) / "journal.json").is_file()


def commit(
    root: Path,
    state: State,
    changes: list[FileChange],
    backups: dict[str, bytes],
) -> None:
    """Write ``backups`` (paths relative to ``.patchkit/``), then ``changes``, then ``state``.

    All or nothing: on any failure (a full disk, a permission error, Ctrl-C)
    the files already written are restored, this run's backups and journal
    are removed, and the tree is as before. If even the restore fails, the
    journal stays and the next run rolls back.
    """
    txn = _txn_dir(state)
    new_state = state.to_bytes()
    stored: list[Path] = []
    written: list[FileChange] = []
    try:
        shutil.rmtree(txn, ignore_errors=True)  # leftovers of a run that died before its journal
        for change in changes:
            if change.before is not None:
                _store(state, f"txn/orig/{change.path}", change.before, stored)
        for relpath, data in backups.items():
            _store(state, relpath, data, stored)
        _store(state, "txn/journal.json", _journal(changes, new_state), stored)
        for change in changes:
            _write(inside(root, change.path, "apply"), change.after)
            written.append(change)
        write_atomic(state.path, new_state)
    except BaseException as exc:
        _undo(root, txn, written, stored)
        if isinstance(exc, OSError):
            raise PatchkitError(
                f"{os_error_line(exc, 'writing')}; the {len(written)} file(s) already "
                "written were restored, nothing changed"
            ) from None
        raise
    shutil.rmtree(txn, ignore_errors=True)


def _store(state: State, relpath: str, data: bytes, stored: list[Path]) -> None:
    """Write one of patchkit's own files under ``.patchkit/`` and remember it for undo."""
    path = inside(state.directory, relpath, str(state.directory), top=None)
    stored.append(path)
    write_atomic(path, data)


def _journal(changes: list[FileChange], new_state: bytes) -> bytes:
    def digest(data: bytes | None) -> str | None:
        return None if data is None else sha256_bytes(data)

    journal = {
        "state_sha256": sha256_bytes(new_state),
        "files": [
            {"path": c.path, "before": digest(c.before), "after": digest(c.after)} for c in changes
        ],
    }
    return json.dumps(journal, indent=2).encode()


def _undo(root: Path, txn: Path, written: list[FileChange], stored: list[Path]) -> None:
    """Put the tree back after a failed commit; keep the journal if that fails."""
    try:
        _restore(root, written)
    except BaseException as exc:
        raise PatchkitError(
            f"restoring the tree after a failed write failed too ({exc}); the next "
            "`patchkit apply` or `patchkit revert` rolls the run back from its journal"
        ) from None
    for path in stored:
        remove_if_present(path)
        remove_if_present(tmp_sibling(path))
    shutil.rmtree(txn, ignore_errors=True)


def _write(path: Path, data: bytes | None) -> None:
    if data is None:
        path.unlink()
    else:
        write_atomic(path, data, like=path)


def _restore(root: Path, changes: list[FileChange]) -> None:
    for change in reversed(changes):
        path = inside(root, change.path, "rollback")
        remove_if_present(tmp_sibling(path))
        if change.before is None:
            remove_if_present(path)
        else:
            write_atomic(path, change.before, like=path)


@dataclass(frozen=True)
class _JournalEntry:
    path: str
    before: str | None
    after: str | None


def _read_journal(path: Path) -> tuple[str, list[_JournalEntry]]:
    """The journal, validated like the state file: paths under vllm/, sha256 values."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or set(data) != {"state_sha256", "files"}:
            raise ValueError("wrong keys")
        entries = []
        for raw in data["files"]:
            if not isinstance(raw, dict) or set(raw) != {"path", "before", "after"}:
                raise ValueError("a file entry is malformed")
            checked_relpath(raw["path"], f"{path}")
            for key in ("before", "after"):
                if raw[key] is not None and not is_sha256(raw[key]):
                    raise ValueError(f"{raw['path']}: {key} is not a sha256")
            entries.append(_JournalEntry(raw["path"], raw["before"], raw["after"]))
        if not is_sha256(data["state_sha256"]):
            raise ValueError("state_sha256 is not a sha256")
    except (ValueError, TypeError, UnicodeDecodeError, PatchkitError) as exc:
        raise PatchkitError(
            f"{path}: invalid journal ({exc}); it was not acted on. Reinstall vLLM "
            f"(pip install --force-reinstall --no-deps vllm), then delete {path.parent}"
        ) from None
    return data["state_sha256"], entries


def recover(root: Path, state: State) -> list[str]:
    """Finish or undo a run that died mid-write; returns what was done."""
    txn = _txn_dir(state)
    journal_path = txn / "journal.json"
    if not journal_path.is_file():
        if txn.exists():  # died before its journal: the tree was not touched yet
            shutil.rmtree(txn)
        return []
    state_sha, entries = _read_journal(journal_path)
    paths = {e.path: inside(root, e.path, str(journal_path)) for e in entries}
    for path in paths.values():
        remove_if_present(tmp_sibling(path))
    if sha256_file(state.path) == state_sha:
        shutil.rmtree(txn)
        return ["an interrupted run had already committed; removed its journal"]
    restored = []
    for entry in entries:
        path = paths[entry.path]
        current = sha256_file(path)
        if current == entry.before:
            continue
        if current != entry.after:
            raise PatchkitError(
                f"{path}: changed after an interrupted patchkit run, so it cannot be "
                f"rolled back safely; reinstall vLLM, then delete {txn}"
            )
        if entry.before is None:
            remove_if_present(path)
        else:
            orig = inside(txn, f"orig/{entry.path}", str(journal_path), top=None)
            original = read_or_none(orig)
            if original is None or sha256_bytes(original) != entry.before:
                raise PatchkitError(
                    f"{txn}: the journal's copy of {entry.path} is missing or damaged; "
                    f"reinstall vLLM, then delete {txn}"
                )
            write_atomic(path, original, like=path)
        restored.append(entry.path)
    shutil.rmtree(txn)
    return [f"rolled back an interrupted run: restored {p}" for p in restored] or [
        "an interrupted run had changed nothing; removed its journal"
    ]
