"""Small filesystem primitives that never leave a half-written file behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP_SUFFIX = ".patchkit-tmp"


def tmp_sibling(path: Path) -> Path:
    """The temporary file that :func:`write_atomic` uses for ``path``."""
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def write_atomic(path: Path, data: bytes, like: Path | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file and os.replace.

    ``like``: copy the permission bits of this file (the one being replaced),
    so a patched module keeps the mode pip gave it. The temporary file is
    created fresh (O_EXCL, O_NOFOLLOW): a link planted under its name is
    removed, never written through.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    remove_if_present(tmp)
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "wb") as handle:
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
