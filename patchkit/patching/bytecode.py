"""Remove the bytecode that would hide a patch.

Python checks a .pyc against its source's mtime and size; a patch that keeps
both, or hash-based .pyc files built with ``--invalidation-mode
unchecked-hash`` (common in images), would keep running the old code. So
every touched module's bytecode is deleted, for every interpreter tag.
(vLLM's and Triton's compile caches: ``caches.py``.)

Bytecode is removed after the patches are committed, so a failure here (a
root-owned ``__pycache__``) is a warning in the report, never a rollback.
"""

from __future__ import annotations

from patchkit.codes import Code, Reason
from patchkit.fs.safepath import Root, UnsafePath


def bytecode_paths(fs: Root, relpath: str) -> list[str]:
    """Every .pyc inside the tree compiled from ``relpath``, whichever Python built it.

    A ``__pycache__`` that is a symbolic link is not looked into; bytecode
    under ``sys.pycache_prefix`` lies outside the tree and is left alone (the
    interpreter checks it by the source's mtime and size, which a patch
    changes).
    """
    directory, _, name = relpath.rpartition("/")
    if not name.endswith(".py"):
        return []
    stem = name[: -len(".py")]
    cache = f"{directory}/__pycache__"
    try:
        names = fs.names(cache, "bytecode")
    except UnsafePath:
        names = []
    found = [f"{cache}/{n}" for n in names if n.startswith(f"{stem}.") and n.endswith(".pyc")]
    legacy = f"{directory}/{stem}.pyc"
    if fs.lstat(legacy, "bytecode") is not None:
        found.append(legacy)
    return sorted(found)


def remove_bytecode(fs: Root, relpaths: list[str]) -> tuple[list[str], list[Reason]]:
    """Delete the bytecode of each touched module; (what was removed, and why what could
    not be removed is left: a bytecode-left warning each)."""
    removed, problems = [], []
    for relpath in relpaths:
        try:
            found = bytecode_paths(fs, relpath)
        except OSError as exc:
            problems.append(_problem(fs, relpath, exc))
            continue
        for pyc in found:
            try:
                if fs.unlink(pyc, "bytecode"):
                    removed.append(str(fs.full(pyc)))
            except (OSError, UnsafePath) as exc:
                problems.append(_problem(fs, pyc, exc))
    return removed, problems


def _problem(fs: Root, relpath: str, exc: Exception) -> Reason:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return Reason.of(Code.BYTECODE_LEFT, path=str(fs.full(relpath)), why=why)
