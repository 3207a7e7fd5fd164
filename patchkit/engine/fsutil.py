"""Reading settings files and writing patchkit's own cache, without hanging or half-writing.

(Files of a vLLM tree go through :class:`patchkit.engine.safepath.Root` instead.)
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from patchkit.engine.safepath import kind_of

MAX_SETTINGS_BYTES = 1 << 20


def read_json_file(path: Path) -> object:
    """A settings file's JSON; ValueError unless it is a regular file of sane size and depth.

    The type is checked before the open and again on the descriptor, so a
    FIFO or a device named like a config file is refused instead of waited on.
    """
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{kind_of(info.st_mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("not a regular file")
        raw = handle.read(MAX_SETTINGS_BYTES + 1)
    return decode_json(raw, MAX_SETTINGS_BYTES)


def read_user_json(path: Path) -> object:
    """A model's or adapter's JSON file; ValueError unless it is a regular file of sane size.

    Unlike :func:`read_json_file` a symbolic link is followed (a Hugging Face
    cache snapshot is all links into ``blobs/``), but what it reaches is checked
    by type before the open and again on the descriptor, so a FIFO named
    config.json is refused instead of waited on for ever. OSError when absent.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{kind_of(mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("not a regular file")
        raw = handle.read(MAX_SETTINGS_BYTES + 1)
    return decode_json(raw, MAX_SETTINGS_BYTES)


def decode_json(raw: bytes, limit: int) -> object:
    """JSON from bytes; ValueError (never RecursionError) for anything too big, deep or odd."""
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None


def write_cache_file(path: Path, data: bytes) -> None:
    """Write a file of patchkit's own cache atomically (a unique temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
