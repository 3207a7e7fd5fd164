"""The words of what patchkit says on a release its catalogue has not decided: a patch
whose code vLLM changed (``changed-upstream``) and a known issue seen up to an older
release; :mod:`patchkit.cli.words` takes them in.

Both name what they read on the tree, so that side by side they agree: the lines a
patch's hunk no longer fits (and the first that differs), and the file where the code a
known issue fails in still matches.
"""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


@words(Code.CHANGED_UPSTREAM)
def _changed_upstream(r: Reason, _: str) -> str:
    moved = [f"no longer ships {r['gone']} (moved or removed)"] if r["gone"] else []
    if r["changed"]:
        moved.append(
            f"changed the lines {r['patch']} changes in {r['changed']} (hunk #{r['hunk']} "
            f"{r['detail']}; the file is the wheel's own, as its RECORD says)"
        )
    return (
        f"vLLM {r['version']} {' and '.join(moved)}; whether the bug is fixed there is not "
        f"known to this catalogue, tested up to {r['newest']}"
    )


def undecided(r: Reason) -> str:
    """A known issue's words before its text on a release the catalogue has not decided."""
    where = (
        f", and the code it was seen failing in still matches in {', '.join(r['evidence'])}"
        if r["evidence"]
        else "; the catalogue names no code to check it by"
    )
    return (
        f"unknown on vLLM {r['version']}, which this catalogue has not decided (seen up to "
        f"{r['seen_up_to']}{where})"
    )
