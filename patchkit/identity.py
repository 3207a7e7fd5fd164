"""What names a file's bytes and a release: their sha256, and a PEP 440 version.

The state file, the journals and refresh name bytes by sha256; the catalogue,
fetch, the options and the tree's metadata name releases by version. Both are
checked the same way everywhere, so both live here, below every layer that uses
them.
"""

from __future__ import annotations

import hashlib

from packaging.version import InvalidVersion, Version

MAX_VERSION_LENGTH = 200  # PEP 440 sets none; 5,000 digits overflow int() on the way


def is_version(text: object) -> bool:
    """Whether ``text`` is a PEP 440 version (0.26.0, 0.26.0+cu130) of a sane length."""
    if not isinstance(text, str) or len(text) > MAX_VERSION_LENGTH:
        return False
    try:
        Version(text)
    except (InvalidVersion, ValueError):
        return False
    return True


def sha256_bytes(data: bytes) -> str:
    """The sha256 of ``data`` as lowercase hex, as state.json and the journals keep it."""
    return hashlib.sha256(data).hexdigest()
