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

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from patchkit.errors import PatchkitError
from patchkit.fsutil import read_or_none, remove_if_present, write_atomic
from patchkit.state import State
from patchkit.tree import sha256_bytes, sha256_file

LOCK_TIMEOUT_ENV = "PATCHKIT_LOCK_TIMEOUT"


@dataclass(frozen=True)
class FileChange:
    """One file's content before and after (None: absent)."""

    path: str  # relative to the tree root
    before: bytes | None
    after: bytes | None


class TreeLock:
    """An exclusive lock on one tree, waited for up to PATCHKIT_LOCK_TIMEOUT s (60)."""

    def __init__(self, directory: Path):
        self.path = directory / "lock"
        self.timeout = float(os.environ.get(LOCK_TIMEOUT_ENV, "60"))
        self._handle = None

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a+")
        except OSError as exc:
            raise PatchkitError(
                f"cannot write to {self.path.parent}: {exc.strerror}; run patchkit as "
                "the user that owns the vLLM install (root in a Docker image)"
            ) from None

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

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()


def _txn_dir(state: State) -> Path:
    return state.directory / "txn"


def interrupted(state: State) -> bool:
    """True when an earlier run died while writing (its journal is still there)."""
    return (_txn_dir(state) / "journal.json").is_file()


def commit(
    root: Path,
    state: State,
    changes: list[FileChange],
    backups: dict[Path, bytes],
) -> None:
    """Write ``backups``, then ``changes``, then ``state``; all or nothing."""
    txn = _txn_dir(state)
    shutil.rmtree(txn, ignore_errors=True)  # leftovers of a run that died before its journal
    new_state = state.to_bytes()
    for change in changes:
        if change.before is not None:
            write_atomic(txn / "orig" / change.path, change.before)
    for path, data in backups.items():
        write_atomic(path, data)
    journal = {
        "state_sha256": sha256_bytes(new_state),
        "files": [
            {
                "path": c.path,
                "before": None if c.before is None else sha256_bytes(c.before),
                "after": None if c.after is None else sha256_bytes(c.after),
            }
            for c in changes
        ],
    }
    write_atomic(txn / "journal.json", json.dumps(journal, indent=2).encode())
    written: list[FileChange] = []
    try:
        for change in changes:
            _write(root / change.path, change.after)
            written.append(change)
        write_atomic(state.path, new_state)
    except BaseException as exc:
        _restore(root, written)
        shutil.rmtree(txn, ignore_errors=True)
        if isinstance(exc, OSError):
            where = exc.filename or "the tree"
            raise PatchkitError(
                f"writing {where} failed ({exc.strerror}); the {len(written)} file(s) "
                "already written were restored, nothing changed"
            ) from None
        raise
    shutil.rmtree(txn, ignore_errors=True)


def _write(path: Path, data: bytes | None) -> None:
    if data is None:
        path.unlink()
    else:
        write_atomic(path, data, like=path)


def _restore(root: Path, changes: list[FileChange]) -> None:
    for change in reversed(changes):
        path = root / change.path
        if change.before is None:
            remove_if_present(path)
        else:
            write_atomic(path, change.before, like=path)


def recover(root: Path, state: State) -> list[str]:
    """Finish or undo a run that died mid-write; returns what was done."""
    txn = _txn_dir(state)
    journal_path = txn / "journal.json"
    if not journal_path.is_file():
        return []
    journal = json.loads(journal_path.read_text(encoding="utf-8"))
    if sha256_file(state.path) == journal["state_sha256"]:
        shutil.rmtree(txn)
        return ["an interrupted run had already committed; removed its journal"]
    restored = []
    for entry in journal["files"]:
        path = root / entry["path"]
        current = sha256_file(path)
        if current == entry["before"]:
            continue
        if current != entry["after"]:
            raise PatchkitError(
                f"{path}: changed after an interrupted patchkit run, so it cannot be "
                f"rolled back safely; reinstall vLLM, then delete {txn}"
            )
        if entry["before"] is None:
            remove_if_present(path)
        else:
            original = read_or_none(txn / "orig" / entry["path"])
            if original is None or sha256_bytes(original) != entry["before"]:
                raise PatchkitError(
                    f"{txn}: the journal's copy of {entry['path']} is missing or damaged; "
                    f"reinstall vLLM, then delete {txn}"
                )
            write_atomic(path, original, like=path)
        restored.append(entry["path"])
    shutil.rmtree(txn)
    return [f"rolled back an interrupted run: restored {p}" for p in restored] or [
        "an interrupted run had changed nothing; removed its journal"
    ]
