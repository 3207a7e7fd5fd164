"""The words of what stops a run before it writes: a lock another run holds, a lock
timeout that is no number of seconds (:mod:`patchkit.fs.locks`), and of the catalogue's
journal, what refresh refuses on and what its recovery did
(:mod:`patchkit.catalogue.journal`); :mod:`patchkit.cli.words` takes them into its own
registry."""

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


# ----- the catalogue's journal (patchkit.catalogue.journal, refresh's) -----


@words(Code.JOURNAL_TREE_NOT_REAL)
def _tree_not_real(r: Reason, _: str) -> str:
    return (
        f"{r['tree']}: refresh names the tree in its journal by a path without links, and "
        f"{r['real']} is not the same directory; pass --target the tree's real path"
    )


@words(Code.CATALOGUE_FILE_TOO_LARGE)
def _too_large(r: Reason, _: str) -> str:
    return (
        f"{r['path']}: more than {r['most']} bytes, more than a catalogue file may hold; "
        "nothing was written"
    )


@words(Code.CATALOGUE_UNDO_FAILED)
def _undo_failed(r: Reason, _: str) -> str:
    return (
        f"putting the catalogue back after a failed refresh failed too ({r['error']}); "
        f"`patchkit refresh --recover` puts it back from {r['journal']}"
    )


@words(Code.CATALOGUE_RECOVERY_FAILED)
def _recovery_failed(r: Reason, _: str) -> str:
    return (
        f"{r['error']}; the catalogue keeps its journal ({r['journal']}) for "
        "`patchkit refresh --recover`"
    )


@words(Code.JOURNAL_NOT_ACTED_ON)
def _not_acted_on(r: Reason, _: str) -> str:
    problem = WORDS[r["problem"].code](r["problem"], "")
    return (
        f"{r['journal']}: an interrupted refresh left this journal, and {problem}; it was "
        f"not acted on. Restore the catalogue (git checkout -- {r['catalogue']}), then delete "
        f"{r['staging']}"
    )


@words(Code.JOURNAL_TREE_UNREADABLE)
def _tree_unreadable(r: Reason, _: str) -> str:
    return f"its tree {r['tree']} cannot be read: {r['error']}"


@words(Code.JOURNAL_UNSAFE)
def _unsafe(r: Reason, _: str) -> str:
    return r["error"]


@words(Code.JOURNAL_FILE_CHANGED)
def _file_changed(r: Reason, _: str) -> str:
    return f"{r['path']} was changed after the interrupted refresh"


@words(Code.JOURNAL_COPY_MISSING)
def _copy_missing(r: Reason, _: str) -> str:
    return f"its copy of {r['path']} is missing or damaged"


@words(Code.JOURNAL_INVALID)
def _invalid(r: Reason, _: str) -> str:
    return f"invalid journal ({r['why']})"


@words(Code.CATALOGUE_STAGING_REMOVED)
def _staging_removed(r: Reason, _: str) -> str:
    return "removed the staging of a refresh that was interrupted before it wrote anything"


@words(Code.CATALOGUE_RECOVERED)
def _recovered(r: Reason, _: str) -> str:
    done = "finished" if r["finished"] else "rolled back"
    return f"{done} an interrupted refresh of {', '.join(r['paths'])}"
