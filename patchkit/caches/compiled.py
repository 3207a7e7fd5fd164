"""Find and clear vLLM's torch.compile cache and Triton's kernel cache.

Both can hold code built from the unpatched sources, so ``--clear-caches``
removes them. Their locations come from the environment
(``VLLM_CACHE_ROOT``, ``TRITON_CACHE_DIR``, ...), which makes them hostile
input: ``TRITON_CACHE_DIR=`` once resolved to the working directory and
deleted it. So a cache is cleared only when

* it is an absolute path without ``.``/``..``, and no component of it, from
  ``/`` down, is a symbolic link (it is opened that way, one component at a
  time, and everything after goes through that descriptor);
* it holds nothing that the user or the vLLM tree needs: it is not ``/``,
  the home directory, or an ancestor of the working directory, the tree or
  patchkit's own cache, nor inside the tree;
* every entry in it has the layout that vLLM or Triton write, and no
  directory in it is another mount (a bind mount under a kernel-hash name is
  someone's data): removal never crosses a mount point or follows a link.

Otherwise it is left alone, and the report says why. A cache that is not
there is reported as such, not as cleared.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, os_error_line
from patchkit.fs.safepath import Root, Usage, mount_id, mount_points_below, remove_entry

_HASH = re.compile(r"[A-Z2-7]{52}|[0-9a-f]{64}")
TRITON_CACHE = "Triton kernel cache"


def _triton_entry(fs: Root, name: str, mode: int) -> bool:
    """Triton's FileCacheManager: one directory of files per kernel key (base32 or hex sha256).

    The whole layout is checked, not only the names: a directory of Docker
    containers also has 64-hex names, but with directories inside.
    """
    if not (stat.S_ISDIR(mode) and _HASH.fullmatch(name)):
        return False
    return all(_is_file(fs, f"{name}/{inner}") for inner in fs.names(name, "cache"))


def _vllm_entry(fs: Root, name: str, mode: int) -> bool:
    """vLLM: ``<10 hex>/rank_<r>_<dp>/`` per compiled config, and ``torch_aot_compile/<sha256>``."""
    if not stat.S_ISDIR(mode):
        return False
    if name == "torch_aot_compile":
        return all(re.fullmatch(r"[0-9a-f]{64}", n) for n in fs.names(name, "cache"))
    if re.fullmatch(r"[0-9a-f]{10}", name) is None:
        return False
    return all(re.fullmatch(r"rank_\d+_\d+", inner) for inner in fs.names(name, "cache"))


def _is_file(fs: Root, relpath: str) -> bool:
    found = fs.lstat(relpath, "cache")
    return found is not None and stat.S_ISREG(found.st_mode)


@dataclass(frozen=True)
class CacheDir:
    name: str
    path: Path | None  # None when the environment gives no usable path
    source: str  # how it was found, for messages: "TRITON_CACHE_DIR='...'" or "default"
    is_entry: Callable[[Root, str, int], bool]


def cache_dirs() -> list[CacheDir]:
    """vLLM's compile cache and Triton's kernel cache, resolved as those tools do."""
    home = Path.home()
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    vllm_root = os.environ.get("VLLM_CACHE_ROOT")
    if vllm_root is None:
        vllm_path, vllm_source = Path(cache_home) / "vllm", "default"
    else:
        vllm_path, vllm_source = (
            Path(os.path.expanduser(vllm_root)),
            f"VLLM_CACHE_ROOT={vllm_root!r}",
        )
    # Triton treats an empty or blank TRITON_CACHE_DIR as unset.
    triton_dir = (os.environ.get("TRITON_CACHE_DIR") or "").strip()
    if triton_dir:
        triton_path, triton_source = Path(triton_dir), f"TRITON_CACHE_DIR={triton_dir!r}"
    else:
        triton_home = os.environ.get("TRITON_HOME") or str(home)
        triton_path, triton_source = Path(triton_home) / ".triton" / "cache", "default"
    return [
        CacheDir(
            "vLLM torch.compile cache",
            vllm_path / "torch_compile_cache" if vllm_path.is_absolute() else None,
            vllm_source,
            _vllm_entry,
        ),
        CacheDir(
            TRITON_CACHE,
            triton_path if triton_path.is_absolute() else None,
            triton_source,
            _triton_entry,
        ),
    ]


def refusal(cache: CacheDir, fs: Root, protected: list[Path], tree_root: Path) -> Reason | None:
    """Why the opened cache ``fs`` must be left alone, or None when it is safe to clear."""
    path = cache.path
    here = os.fstat(fs.fd)
    for keep in [Path("/"), Path.home(), *protected]:
        held = _ancestor_ids(keep)
        if (here.st_dev, here.st_ino) in held:
            kept = str(held[(here.st_dev, here.st_ino)])
            return Reason.of(Code.CACHE_HOLDS_KEPT, path=str(path), kept=kept)
    root = tree_root.resolve()
    if root == path or root in path.parents:
        return Reason.of(Code.CACHE_IN_TREE, path=str(path), tree=str(tree_root))
    for name in fs.names("", "cache"):
        found = fs.lstat(name, "cache")
        if found is None:
            continue
        if stat.S_ISLNK(found.st_mode) or not cache.is_entry(fs, name, found.st_mode):
            return Reason.of(Code.CACHE_FOREIGN_ENTRY, path=str(path), entry=name, cache=cache.name)
    mounted = mount_points_below(fs.fd, path)
    if mounted:
        return Reason.of(Code.CACHE_MOUNT_INSIDE, mount=str(mounted), cache=cache.name)
    return None


def _ancestor_ids(path: Path) -> dict[tuple[int, int], Path]:
    """(st_dev, st_ino) of ``path`` (resolved) and each directory above it."""
    found = {}
    for directory in [path.resolve(), *path.resolve().parents]:
        try:
            info = os.stat(directory)
        except OSError:
            continue
        found[(info.st_dev, info.st_ino)] = path
    return found


CacheState = Literal["cleared", "absent", "left-alone"]


@dataclass(frozen=True)
class CacheResult:
    """What clearing one cache did: cleared (and how much), absent, or left alone and why."""

    name: str
    path: str  # the cache's path, or how the environment named it when it gave no usable path
    state: CacheState
    files: int = 0  # removed
    bytes: int = 0
    reason: Reason | None = None  # why it was left alone, or why there was nothing to clear

    @property
    def removed(self) -> bool:
        return self.state == "cleared"


def clear_caches(tree_root: Path) -> list[CacheResult]:
    """Clear each cache that passes :func:`refusal`; report what went, or why not."""
    from patchkit.fs.places import cache_root

    protected = [Path.cwd(), tree_root, cache_root()]
    return [_clear_one(cache, protected, tree_root) for cache in cache_dirs()]


def _clear_one(cache: CacheDir, protected: list[Path], tree_root: Path) -> CacheResult:
    path = str(cache.path or cache.source)

    def result(state: CacheState, usage: Usage | None = None, reason: Reason | None = None):
        usage = usage or Usage()
        return CacheResult(cache.name, path, state, usage.files, usage.bytes, reason)

    if cache.path is None:
        return result("left-alone", reason=Reason.of(Code.CACHE_NOT_ABSOLUTE, source=cache.source))
    try:
        fs = Root.open_absolute(cache.path, cache.source)
    except FileNotFoundError:
        return result("absent", reason=Reason.of(Code.CACHE_ABSENT, path=str(cache.path)))
    except PatchkitError as exc:
        unsafe = Reason.of(Code.CACHE_UNSAFE, error=str(exc), cause=exc.reason)
        return result("left-alone", reason=unsafe)
    except OSError as exc:
        return result("left-alone", reason=_os_reason(exc, "opening", cache))
    with fs:
        try:
            why = refusal(cache, fs, protected, tree_root)
            if why is not None:
                return result("left-alone", reason=why)
            return result("cleared", _remove_entries(fs))
        except PatchkitError as exc:
            partly = Reason.of(Code.CACHE_PARTLY_CLEARED, error=str(exc), cause=exc.reason)
            return result("left-alone", reason=partly)
        except OSError as exc:
            return result("left-alone", reason=_os_reason(exc, "clearing", cache))


def _os_reason(exc: OSError, doing: str, cache: CacheDir) -> Reason:
    """An OSError opening or clearing the cache: os_error_line's one line (the variable
    to shorten where the path is too long), the cache and what patchkit was doing."""
    variable = cache.source.split("=")[0] if "=" in cache.source else "HOME (the default)"
    line = os_error_line(exc, f"{doing} the {cache.name} ({cache.source}):", too_long=variable)
    return Reason.of(Code.CACHE_OS_ERROR, doing=doing, cache=cache.name, error=line)


def _remove_entries(fs: Root) -> Usage:
    mount = mount_id(fs.fd)
    usage = Usage()
    for name in fs.names("", "cache"):
        usage = usage + remove_entry(fs.fd, name, mount, fs.full(name))
    return usage


def cache_entries(cache: CacheDir) -> list[tuple[str, float]]:
    """(name, mtime) of each entry of a cache, read without following links; [] if unusable."""
    if cache.path is None:
        return []
    try:
        with Root.open_absolute(cache.path, cache.source) as fs:
            found = [(name, fs.lstat(name, "cache")) for name in fs.names("", "cache")]
    except (OSError, PatchkitError):
        return []
    return [(name, info.st_mtime) for name, info in found if info is not None]
