"""Small filesystem primitives that never leave a half-written file behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: Path, data: bytes, like: Path | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file and os.replace.

    ``like``: copy the permission bits of this file (the one being replaced),
    so a patched module keeps the mode pip gave it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.patchkit-tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if like is not None and like.exists():
            shutil.copymode(like, tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_if_present(tmp)
        raise


def remove_if_present(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
