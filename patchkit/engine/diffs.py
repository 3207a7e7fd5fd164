"""Write unified diffs in the form patchkit's catalogue keeps them (``-p1``, ``a/``, ``b/``).

``patchkit refresh`` makes a variant's diff from a file's original and its
patched text; this is the one place that format is written, so a refreshed
diff parses back (:mod:`patchkit.engine.hunks`) to exactly the change made.
"""

from __future__ import annotations

import difflib

NO_NEWLINE = "\\ No newline at end of file\n"


def unified_diff(path: str, old: str | None, new: str | None, context: int = 3) -> str:
    """The diff of one file; ``old`` None: the file is created, ``new`` None: deleted."""
    before = [] if old is None else old.splitlines(keepends=True)
    after = [] if new is None else new.splitlines(keepends=True)
    lines = difflib.unified_diff(
        before,
        after,
        "/dev/null" if old is None else f"a/{path}",
        "/dev/null" if new is None else f"b/{path}",
        n=context,
    )
    return "".join(line if line.endswith("\n") else f"{line}\n{NO_NEWLINE}" for line in lines)
