"""Find and clear vLLM's torch.compile cache and Triton's kernel cache.

Both can hold code built from the unpatched sources, so ``--clear-caches``
removes them. Their locations come from the environment
(``VLLM_CACHE_ROOT``, ``TRITON_CACHE_DIR``, ...), which makes them hostile
input: ``TRITON_CACHE_DIR=`` once resolved to the working directory and
deleted it. So a cache is cleared only when it is a real directory at an
absolute path, holds nothing that the user or the vLLM tree needs (it is not
``/``, the home directory, or an ancestor of the working directory, the tree
or patchkit's own cache), and every entry in it has the layout that vLLM or
Triton write. Otherwise it is left alone, and the report says why.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _triton_entry(entry: Path) -> bool:
    """Triton's FileCacheManager: one directory per kernel key (base32 or hex sha256)."""
    return entry.is_dir() and re.fullmatch(r"[A-Z2-7]{52}|[0-9a-f]{64}", entry.name) is not None


def _vllm_entry(entry: Path) -> bool:
    """vLLM: ``<10 hex>/rank_*`` per compiled config, and ``torch_aot_compile/<sha256>``."""
    if not entry.is_dir():
        return False
    if entry.name == "torch_aot_compile":
        return all(re.fullmatch(r"[0-9a-f]{64}", e.name) for e in entry.iterdir())
    return re.fullmatch(r"[0-9a-f]{10}", entry.name) is not None


@dataclass(frozen=True)
class CacheDir:
    name: str
    path: Path | None  # None when the environment gives no usable path
    source: str  # how it was found, for messages
    is_entry: Callable[[Path], bool]


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
            "Triton kernel cache",
            triton_path if triton_path.is_absolute() else None,
            triton_source,
            _triton_entry,
        ),
    ]


def refusal(cache: CacheDir, protected: list[Path], tree_root: Path) -> str | None:
    """Why ``cache`` must be left alone, or None when it is safe to clear."""
    if cache.path is None:
        return f"{cache.source} is not an absolute path"
    path = cache.path
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(mode):
        return f"{path} is not a directory"
    real = path.resolve()
    for keep in [Path("/"), Path.home(), *protected]:
        keep = keep.resolve()
        if real == keep or real in keep.parents:
            return f"{path} holds {keep}"
    if tree_root.resolve() in real.parents:
        return f"{path} is inside the vLLM tree {tree_root}"
    entries = list(path.iterdir())
    if not entries:
        return None
    foreign = next((e for e in entries if e.is_symlink() or not cache.is_entry(e)), None)
    if foreign is not None:
        return f"{path} holds {foreign.name!r}, which is not part of the {cache.name}'s layout"
    return None


def clear_caches(tree_root: Path) -> list[dict]:
    """Clear each cache that passes :func:`refusal`; report what went or why not."""
    from patchkit.fetch import cache_root

    protected = [Path.cwd(), tree_root, cache_root()]
    report = []
    for cache in cache_dirs():
        entry = {"name": cache.name, "path": str(cache.path or cache.source)}
        if cache.path is None or os.path.lexists(cache.path):
            why = refusal(cache, protected, tree_root)
        else:
            why = None
        if why is not None:
            report.append({**entry, "removed": False, "files": 0, "bytes": 0, "reason": why})
            continue
        files = size = 0
        if cache.path.is_dir():
            for child in list(cache.path.iterdir()):
                child_files, child_size = _usage(child)
                shutil.rmtree(child)
                files, size = files + child_files, size + child_size
        report.append({**entry, "removed": True, "files": files, "bytes": size, "reason": None})
    return report


def _usage(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size
