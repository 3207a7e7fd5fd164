"""Remove bytecode and compile caches that would hide a patch.

Python checks a .pyc against its source's mtime and size; a patch that keeps
both, or hash-based .pyc files built with ``--invalidation-mode
unchecked-hash`` (common in images), would keep running the old code. So
every touched module's bytecode is deleted, for every interpreter tag.
vLLM's torch.compile cache and Triton's kernel cache can also hold code
built from the unpatched sources; ``--clear-caches`` removes them.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


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
    """Delete the bytecode of each touched module; returns what was removed."""
    removed = []
    for relpath in relpaths:
        for pyc in bytecode_files(root, relpath):
            pyc.unlink(missing_ok=True)
            removed.append(str(pyc))
    return removed


@dataclass(frozen=True)
class CacheDir:
    name: str
    path: Path


def cache_dirs() -> list[CacheDir]:
    """vLLM's compile cache and Triton's kernel cache, as those tools resolve them."""
    home = Path.home()
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", home / ".cache"))
    vllm_root = Path(os.environ.get("VLLM_CACHE_ROOT", cache_root / "vllm"))
    triton_home = Path(os.environ.get("TRITON_HOME", home))
    triton_cache = Path(os.environ.get("TRITON_CACHE_DIR", triton_home / ".triton" / "cache"))
    return [
        CacheDir("vLLM torch.compile cache", vllm_root / "torch_compile_cache"),
        CacheDir("Triton kernel cache", triton_cache),
    ]


def clear_caches() -> list[dict]:
    """Remove the caches; returns name, path, files and bytes removed for each."""
    report = []
    for cache in cache_dirs():
        files, size = _usage(cache.path)
        if cache.path.exists():
            shutil.rmtree(cache.path, ignore_errors=True)
        report.append({"name": cache.name, "path": str(cache.path), "files": files, "bytes": size})
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
