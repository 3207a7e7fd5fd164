"""The commands a refusal names as the way on: apply the patches that still fit, or
make vLLM's files its own again (:mod:`patchkit.cli.words` says them in its refusals).

A refusal is one line that ends with the next command, exact for this tree: the ids
and ``--target`` it was refused on, never "ID" or "the others" for the user to fill in.
"""

from __future__ import annotations


def apply_only(ids, target: str) -> str:
    """``patchkit apply --only A --only B --target T``; ``target`` as the shell reads it
    (shlex-quoted by the caller, as the refusals carry it)."""
    return f"patchkit apply {' '.join(f'--only {i}' for i in ids)} --target {target}"


def after_conflict(fit, reinstall: str | None, target: str) -> str:
    """A conflict refusal's way on: the ``apply --only`` of the patches that still fit, and
    ``reinstall`` (the tree's own command, patchkit.vllmtree.reinstall) where reinstalling
    vLLM makes the conflicting files its own again; or only what is left where nothing
    else fits."""
    ways = []
    if fit:
        ways.append(f"`{apply_only(fit, target)}` applies the others")
    if reinstall:
        ways.append(
            f"`{reinstall}` makes vLLM's files its own again, then `patchkit apply "
            f"--target {target}`"
        )
    if not ways:
        return "no other patch it would take is needed here"
    return "; or ".join(ways)
