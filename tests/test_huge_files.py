"""No file of a tree is read whole past its bound: a huge file is one line, never the
machine's memory.

A vLLM file, the backup patchkit keeps of it, or the dist-info's RECORD made a 4 GiB
sparse file went whole into memory before anything looked at its size (MemoryError,
exit 3, in a child limited to 1 GiB; on a host, the kernel killing patchkit or a
process beside it). Every read through a tree's descriptor now has a bound; past it,
the file is refused by its size before a byte is read, and nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import applied, run_subprocess
from tests.helpers import UTILS, one_line, sha

# A child whose address space is 1 GiB: a file read whole past that is a MemoryError
# (exit 3), not a machine out of memory.
LIMITED = "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
HUGE = 4 << 30

ALL = ("status", "apply", "revert")
BOUND = "larger than 67108864 bytes"
WHERE = {
    "a patched vLLM file": (UTILS, ALL),
    "its backup": (f".patchkit/backups/expand-block-n/{UTILS}", ("revert",)),
    "the dist-info's RECORD": ("vllm-0.26.0.dist-info/RECORD", ALL),
}


@pytest.mark.parametrize("where", WHERE)
def test_a_huge_file_in_the_tree_is_refused_by_its_size(slim_tree_0260, where):
    """The real 0.26.0 tree, applied, then one of its files made a 4 GiB sparse file."""
    relpath, commands = WHERE[where]
    applied(slim_tree_0260)
    huge = slim_tree_0260 / relpath
    with open(huge, "ab") as handle:
        handle.truncate(HUGE)
    before = snapshot_but(slim_tree_0260, huge)
    for command in commands:
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260), code=LIMITED))
        assert BOUND in line and str(huge) in line, line
    assert snapshot_but(slim_tree_0260, huge) == before and huge.stat().st_size == HUGE


def snapshot_but(tree: Path, huge: Path) -> dict[str, str]:
    """sha256 of each file of the tree's vllm/, the huge one's size instead (the test
    reads it no more than patchkit may)."""
    found = {}
    for directory, _, names in os.walk(tree / "vllm"):
        for name in names:
            path = Path(directory) / name
            found[str(path)] = str(path.stat().st_size) if path == huge else sha(path)
    return found
