"""patchkit's own cache folder: fetched trees, the kernel scan's builds and records.

One function, below every package that writes there (releases, caches,
doctor), so none of them imports another to find it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PATCHKIT_CACHE_DIR"


def cache_root() -> Path:
    """$PATCHKIT_CACHE_DIR, else $XDG_CACHE_HOME/patchkit, else ~/.cache/patchkit.

    An XDG_CACHE_HOME that is empty or relative is ignored, as the XDG spec says: an
    empty one (``XDG_CACHE_HOME=``, which images and scripts do set) made the cache
    ``./patchkit`` in whatever directory patchkit ran in, so fetch wrote its trees
    there and took a tree someone had left there for the pristine release.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "patchkit"
