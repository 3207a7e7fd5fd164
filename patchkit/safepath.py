"""Every path patchkit writes, deletes or restores from is checked here first.

patchkit edits other people's site-packages, so a path that comes from
disk (``state.json``, the journal, a diff, a symlink) or from the
environment is hostile until checked. The rules, after what dpkg and git
promise about files they do not own:

* a relative path is POSIX, non-empty, without ``..``, ``.``, empty parts or
  NUL, and stays under its expected top directory (``vllm/`` for the code,
  ``.patchkit/`` for patchkit's own files);
* no component from the tree root down to the file may be a symbolic link:
  writing through one would change a file outside the tree, and replacing
  one would silently break the link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from patchkit.errors import PatchkitError

CODE_TOP = "vllm"


class UnsafePath(PatchkitError):
    """A path that would lead outside the tree, or through a symbolic link."""


def checked_relpath(relpath: object, origin: str, top: str | None = CODE_TOP) -> str:
    """``relpath`` if it is clean, relative and under ``top``; else UnsafePath naming ``origin``."""
    if not isinstance(relpath, str) or not relpath:
        raise UnsafePath(f"{origin}: {relpath!r} is not a relative file path")
    parts = relpath.split("/")
    if (
        "\x00" in relpath
        or PurePosixPath(relpath).is_absolute()
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UnsafePath(f"{origin}: path {relpath!r} leaves the vLLM tree")
    if top is not None and (parts[0] != top or len(parts) < 2):
        raise UnsafePath(f"{origin}: path {relpath!r} is not under {top}/")
    return relpath


def inside(root: Path, relpath: str, origin: str, top: str | None = CODE_TOP) -> Path:
    """``root/relpath`` after checking the path and that no component of it is a symlink.

    Components that do not exist yet are fine (a patch may create a file);
    every one that exists must be a real directory, and the last a real file.
    """
    checked_relpath(relpath, origin, top)
    path = root
    parts = relpath.split("/")
    for depth, part in enumerate(parts, start=1):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return root.joinpath(*parts)
        except NotADirectoryError:
            raise UnsafePath(f"{origin}: {path.parent} is not a directory") from None
        if stat.S_ISLNK(mode):
            raise UnsafePath(
                f"{path} is a symbolic link (to {os.readlink(path)}); patchkit never writes "
                "through or replaces links in a vLLM tree; point --target at the real files"
            )
        if depth < len(parts) and not stat.S_ISDIR(mode):
            raise UnsafePath(f"{origin}: {path} is not a directory")
    return path


def no_links_below(directory: Path) -> None:
    """Refuse ``directory`` if it, or anything below it, is a symbolic link."""
    if directory.is_symlink():
        raise UnsafePath(
            f"{directory} is a symbolic link (to {os.readlink(directory)}); patchkit keeps "
            "its state only in a real directory inside the tree; remove the link"
        )
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                raise UnsafePath(
                    f"{path} is a symbolic link (to {os.readlink(path)}); patchkit's state "
                    f"holds only real files; remove the link (or all of {directory} when "
                    "nothing is applied)"
                )
