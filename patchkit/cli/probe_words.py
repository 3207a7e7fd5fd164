"""The words of probe report's warning about its log (:mod:`patchkit.cli.words` takes
them into its own registry, as it does doctor's and adapter check's)."""

from __future__ import annotations

from collections.abc import Callable

from patchkit.codes import Code, Reason

WORDS: dict[Code, Callable[[Reason, str], str]] = {
    Code.PROBE_LAST_LINE_CUT: lambda r, _: (
        f"{r['path']}:{r['line']}: the last line is cut short ({r['why']}): skipped, "
        f"the {r['seen']} lines before it are reported (the probe stopped mid-write: "
        "a full disk, or a killed server)"
    ),
}
