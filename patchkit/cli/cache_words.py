"""The words of why apply or revert --clear-caches left a compile cache alone, or found
nothing to clear (:mod:`patchkit.caches.compiled`); :mod:`patchkit.cli.words` takes them
into its own registry."""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


@words(Code.CACHE_NOT_ABSOLUTE)
def _not_absolute(r: Reason, _: str) -> str:
    return f"{r['source']} is not an absolute path"


@words(Code.CACHE_ABSENT)
def _absent(r: Reason, _: str) -> str:
    return f"{r['path']} does not exist (nothing to clear)"


@words(Code.CACHE_UNSAFE, Code.CACHE_OS_ERROR)
def _error(r: Reason, _: str) -> str:
    return r["error"]


@words(Code.CACHE_PARTLY_CLEARED)
def _partly(r: Reason, _: str) -> str:
    return f"{r['error']} (partly cleared)"


@words(Code.CACHE_HOLDS_KEPT)
def _holds_kept(r: Reason, _: str) -> str:
    return f"{r['path']} holds {r['kept']}"


@words(Code.CACHE_IN_TREE)
def _in_tree(r: Reason, _: str) -> str:
    return f"{r['path']} is inside the vLLM tree {r['tree']}"


@words(Code.CACHE_FOREIGN_ENTRY)
def _foreign(r: Reason, _: str) -> str:
    return f"{r['path']} holds {r['entry']!r}, which is not part of the {r['cache']}'s layout"


@words(Code.CACHE_MOUNT_INSIDE)
def _mount(r: Reason, _: str) -> str:
    return f"{r['mount']} is a mount point inside the {r['cache']}; patchkit never crosses one"
