"""Remove the bytecode that would hide a patch.

Python checks a .pyc against its source's mtime and size; a patch that keeps
both, or hash-based .pyc files built with ``--invalidation-mode
unchecked-hash`` (common in images), would keep running the old code. So
every touched module's bytecode is deleted, for every interpreter tag.
(vLLM's and Triton's compile caches: ``caches.py``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from patchkit.safepath import UnsafePath, inside


def bytecode_files(root: Path, relpath: str) -> list[Path]:
    """Every .pyc compiled from ``root/relpath``, whichever Python built it."""
    source = root / relpath
    if source.suffix != ".py":
        return []
    found = list((source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"))
    legacy = source.with_suffix(".pyc")
    if legacy.is_file():
        found.append(legacy)
    if sys.pycache_prefix:
        prefixed = Path(sys.pycache_prefix) / source.resolve().parent.relative_to("/")
        found.extend(prefixed.glob(f"{source.stem}.*.pyc"))
    return sorted(found)


def remove_bytecode(root: Path, relpaths: list[str]) -> list[str]:
    """Delete the bytecode of each touched module inside the tree; returns what was removed.

    A ``__pycache__`` that is a symbolic link, and bytecode under
    ``sys.pycache_prefix`` (outside the tree), are left alone: patchkit
    deletes nothing outside the tree. The interpreter checks those by the
    source's mtime and size, which a patch changes.
    """
    removed = []
    for relpath in relpaths:
        for pyc in bytecode_files(root, relpath):
            try:
                inside(root, str(pyc.relative_to(root)), "bytecode")
            except (ValueError, UnsafePath):
                continue
            pyc.unlink(missing_ok=True)
            removed.append(str(pyc))
    return removed
