"""patchkit's own cache folder: fetched trees, the kernel scan's builds and records.

One function, below every package that writes there (releases, caches,
doctor), so none of them imports another to find it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PATCHKIT_CACHE_DIR"


def cache_root() -> Path:
    """$PATCHKIT_CACHE_DIR, else $XDG_CACHE_HOME/patchkit, else ~/.cache/patchkit."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "patchkit"
