"""The console script: Ctrl-C while patchkit is still importing ends with one line, too.

``patchkit.cli.main`` imports click, packaging and the catalogue; a Ctrl-C during
those imports would otherwise print Python's traceback. This module imports
nothing heavy before it can catch that (:mod:`patchkit.cli.exits` imports nothing).
"""

import sys

from patchkit.cli import exits


def main() -> None:
    try:
        import patchkit.cli.main
    except KeyboardInterrupt:
        sys.stderr.write("patchkit: error: interrupted while starting; nothing was done\n")
        raise SystemExit(exits.INTERRUPTED) from None
    patchkit.cli.main.main()
