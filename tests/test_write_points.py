"""Faults at every write point of apply and revert.

An audit hook in a child patchkit counts the file-system writes it makes
(opens for writing, mkdir, rename/replace, unlink, rmdir, rmtree, chmod)
under the tree and, at the N-th, injects a fault: SIGKILL, Ctrl-C
(KeyboardInterrupt) or a full disk (ENOSPC on a write). N walks every
point until the run finishes without reaching it. After each fault the
tree must be byte-identical to pristine or to patched, ``.patchkit/``
included, once the next ``apply`` or ``revert`` has run: no temp files, no
orphan backups, no journal.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import normalized, slim_tree
from tests.fault_helpers import HOOK, MARK, Zygote, on_a_free_zygote, zygotes

# Each run is a fork of a warm patchkit (tests/zygote.py) on a slim real 0.26.0
# tree (~60 files): the points are run WORKERS at a time, each on its own copy.
WORKERS = max(2, os.cpu_count() or 2)


@pytest.fixture(scope="module")
def free_zygotes():
    with zygotes(WORKERS) as free:
        yield free


def run_with_fault(zygote: Zygote, tree: Path, command: str, mode: str, at: int):
    """Run ``command`` with the fault at write ``at``; None once the run has fewer writes."""
    code = HOOK.format(root=str(tree), mode=mode, at=at)
    result = zygote.run(command, "--target", str(tree), code=code)
    if MARK not in result.stderr:
        assert result.returncode == 0, result.stderr
        return None
    result.stderr = result.stderr.replace(MARK, "")
    return result


def clean_run(zygote: Zygote, tree: Path, command: str):
    result = zygote.run(command, "--target", str(tree))
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def references(tmp_path_factory, free_zygotes) -> dict:
    """Pristine and patched 0.26.0 trees, and the normalized snapshot of each."""
    base = tmp_path_factory.mktemp("refs")
    pristine = slim_tree(base / "pristine")
    patched = slim_tree(base / "patched")
    on_a_free_zygote(free_zygotes, lambda warm: clean_run(warm, patched, "apply"))
    return {
        "pristine": pristine,
        "patched": patched,
        "pristine_snapshot": normalized(pristine),
        "patched_snapshot": normalized(patched),
    }


def walk(references, free, tmp_path: Path, start: str, command: str, mode: str, check) -> int:
    """``check(N, tree, result, zygote)`` at every write point N of ``command`` on a ``start``
    tree, WORKERS points at a time; the number of points."""

    def point(at: int) -> bool:
        def faulted(warm) -> bool:
            tree = tmp_path / f"t{at}"
            shutil.copytree(references[start], tree, symlinks=True)
            try:
                result = run_with_fault(warm, tree, command, mode, at)
                if result is not None:
                    check(at, tree, result, warm)
                return result is not None
            finally:
                shutil.rmtree(tree)

        return on_a_free_zygote(free, faulted)

    reached = []
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        while not reached or reached[-1]:
            batch = range(len(reached) + 1, len(reached) + 1 + 2 * WORKERS)
            reached += pool.map(point, batch)
    points = reached.index(False)
    assert not any(reached[points:]), f"{command}: a write point after the last one"
    assert points > 10, f"{command} made only {points} writes: is the hook counting?"
    return points


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_sigkill_at_every_write_point_leaves_no_debris(
    references, free_zygotes, scratch_path, command, start
):
    def check(at, tree, result, warm):
        assert result.returncode == -9, (at, result.stderr)
        recovery = "revert" if at % 2 else "apply"  # both recover, in turns
        clean_run(warm, tree, recovery)
        expected = "pristine_snapshot" if recovery == "revert" else "patched_snapshot"
        assert normalized(tree) == references[expected], f"{command} killed at write {at}"

    assert walk(references, free_zygotes, scratch_path, start, command, "kill", check) > 10


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_ctrl_c_at_every_write_point_exits_130_and_recovers(
    references, free_zygotes, scratch_path, command, start
):
    def check(at, tree, result, warm):
        assert result.returncode == 130, (at, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("patchkit: error: interrupted")
        clean_run(warm, tree, "revert")
        assert normalized(tree) == references["pristine_snapshot"], f"Ctrl-C at write {at}"

    walk(references, free_zygotes, scratch_path, start, command, "interrupt", check)


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_a_full_disk_at_every_write_changes_nothing(
    references, free_zygotes, scratch_path, command, start
):
    failures = []

    def check(at, tree, result, warm):
        if result.returncode == 0:  # a rename or delete: ENOSPC is injected on writes only
            return
        assert result.returncode == 1, (at, result.stderr)
        line = result.stderr.strip().splitlines()
        assert len(line) == 1 and "no space left" in line[0], (at, result.stderr)
        assert normalized(tree) == references[f"{start}_snapshot"], f"ENOSPC at write {at}"
        failures.append(at)

    walk(references, free_zygotes, scratch_path, start, command, "enospc", check)
    assert len(failures) > 3
