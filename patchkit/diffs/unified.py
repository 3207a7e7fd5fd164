"""Write unified diffs in the form patchkit's catalogue keeps them (``-p1``, ``a/``, ``b/``).

``patchkit refresh`` makes a variant's diff from a file's original and its
patched bytes; this is the one place that format is written, so a refreshed
diff parses back (:mod:`patchkit.diffs.hunks`) to exactly the change made.

Lines are split on ``\\n`` alone, as the hunk applier splits them:
``str.splitlines`` would also break a line at a form feed, ``\\v``,
``\\x1c``-``\\x1e``, ``\\x85`` or ``\\u2028`` and write a diff that gives
other bytes back. Bytes that are not UTF-8 pass through unchanged
(surrogateescape both ways).
"""

from __future__ import annotations

import difflib

NO_NEWLINE = "\\ No newline at end of file\n"


def unified_diff(path: str, old: bytes | None, new: bytes | None, context: int = 3) -> bytes:
    """The diff of one file; ``old`` None: the file is created, ``new`` None: deleted."""
    lines = difflib.unified_diff(
        split_lines(old),
        split_lines(new),
        "/dev/null" if old is None else f"a/{path}",
        "/dev/null" if new is None else f"b/{path}",
        n=context,
    )
    text = "".join(line if line.endswith("\n") else f"{line}\n{NO_NEWLINE}" for line in lines)
    return text.encode("utf-8", errors="surrogateescape")


def split_lines(data: bytes | None) -> list[str]:
    """Lines with their ``\\n`` (the last one may lack it), as text that keeps every byte."""
    if not data:
        return []
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return [line.decode("utf-8", errors="surrogateescape") for line in lines]
