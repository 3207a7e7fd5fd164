"""A local file fetch reads because pip's settings name it: opened without hanging.

pip's configuration files (``PIP_CONFIG_FILE``, ``~/.config/pip/pip.conf``),
a find-links directory's wheel or page and a ``file:`` index's page are the
user's files, named by settings anyone can set: ``PIP_CONFIG_FILE=/tmp/fifo``
blocked a plain open() for ever, ``/dev/zero`` was read until memory ran out.
Here a file is looked at before it is opened (a device is never opened), must
be a regular file of at most a given size, is opened with O_NONBLOCK (a FIFO
swapped in since the look does not block) and looked at again on the
descriptor (the same inode). A link is followed: a dotfiles manager links
pip.conf, a wheelhouse links its wheels; what it reaches is checked all the same.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from patchkit.fs.safepath import kind_of


class Refused(ValueError):
    """Why a file is not read (a phrase: 'a FIFO, not a regular file')."""


def open_regular(path: Path | str, limit: int) -> int:
    """A descriptor of ``path``, a regular file of at most ``limit`` bytes.

    Refused (ValueError) when it is anything else; OSError when it cannot be
    looked at (FileNotFoundError when absent, IsADirectoryError for a directory).
    """
    info = os.stat(path)
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    _check(info, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (info.st_dev, info.st_ino):
            raise Refused("replaced while it was opened")
        _check(found, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of ``path`` as :func:`open_regular` admits it; never more than ``limit``."""
    with os.fdopen(open_regular(path, limit), "rb") as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:  # grew since it was looked at
        raise Refused(f"larger than the {limit} bytes allowed")
    return raw


def _check(info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"{kind_of(info.st_mode)}, not a regular file")
    if info.st_size > limit:
        raise Refused(f"{info.st_size} bytes, larger than the {limit} bytes allowed")
