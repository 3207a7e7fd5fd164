"""The words of what stops a run before it writes: a lock another run holds, a lock
timeout that is no number of seconds (:mod:`patchkit.fs.locks`); :mod:`patchkit.cli.words`
takes them into its own registry."""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


@words(Code.LOCK_BUSY, Code.CATALOGUE_BUSY)
def _busy(r: Reason, _: str) -> str:
    who = (
        "another patchkit run holds"
        if r.code == Code.LOCK_BUSY
        else "another patchkit refresh is writing"
    )
    return (
        f"{who} {r['path']} (waited {r['waited']:.0f} s); let it finish, then run the command again"
    )


@words(Code.LOCK_TIMEOUT_INVALID)
def _timeout(r: Reason, _: str) -> str:
    # read before any lock is taken, so before anything could have changed
    return (
        f"{r['variable']}={r['value']!r} is not a number of seconds (0 or more; "
        f"unset it for the default {r['default']:.0f}); nothing was changed"
    )
