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

import shutil
from pathlib import Path

import pytest

from tests.conftest import normalized, slim_tree
from tests.fault_helpers import HOOK, MARK, Zygote

# The real 0.26.0 files that apply, revert and the decisions read, with the
# wheel's dist-info: a tree of ~300 files instead of ~2,250, so that each of
# the hundreds of runs below copies little.


@pytest.fixture(scope="module")
def zygote():
    warm = Zygote()
    yield warm
    warm.close()


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
def references(tmp_path_factory, zygote) -> dict:
    """Pristine and patched 0.26.0 trees, and the normalized snapshot of each."""
    base = tmp_path_factory.mktemp("refs")
    pristine = slim_tree(base / "pristine")
    patched = slim_tree(base / "patched")
    clean_run(zygote, patched, "apply")
    return {
        "pristine": pristine,
        "patched": patched,
        "pristine_snapshot": normalized(pristine),
        "patched_snapshot": normalized(patched),
    }


def walk(references, zygote, tmp_path: Path, start: str, command: str, mode: str):
    """Yield (N, tree, result) for every write point of ``command`` on a ``start`` tree."""
    at = 1
    while True:
        tree = tmp_path / f"t{at}"
        shutil.copytree(references[start], tree, symlinks=True)
        result = run_with_fault(zygote, tree, command, mode, at)
        if result is None:
            shutil.rmtree(tree)
            assert at > 10, f"{command} made only {at - 1} writes: is the hook counting?"
            return
        yield at, tree, result
        shutil.rmtree(tree)
        at += 1


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_sigkill_at_every_write_point_leaves_no_debris(
    references, zygote, tmp_path, command, start
):
    points = 0
    for at, tree, result in walk(references, zygote, tmp_path, start, command, "kill"):
        assert result.returncode == -9, (at, result.stderr)
        recovery = "revert" if at % 2 else "apply"  # both recover, in turns
        clean_run(zygote, tree, recovery)
        expected = "pristine_snapshot" if recovery == "revert" else "patched_snapshot"
        assert normalized(tree) == references[expected], f"{command} killed at write {at}"
        points += 1
    assert points > 10


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_ctrl_c_at_every_write_point_exits_130_and_recovers(
    references, zygote, tmp_path, command, start
):
    for at, tree, result in walk(references, zygote, tmp_path, start, command, "interrupt"):
        assert result.returncode == 130, (at, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("patchkit: error: interrupted")
        clean_run(zygote, tree, "revert")
        assert normalized(tree) == references["pristine_snapshot"], f"Ctrl-C at write {at}"


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_a_full_disk_at_every_write_changes_nothing(references, zygote, tmp_path, command, start):
    failures = 0
    for at, tree, result in walk(references, zygote, tmp_path, start, command, "enospc"):
        if result.returncode == 0:  # a rename or delete: ENOSPC is injected on writes only
            continue
        assert result.returncode == 1, (at, result.stderr)
        line = result.stderr.strip().splitlines()
        assert len(line) == 1 and "no space left" in line[0], (at, result.stderr)
        assert normalized(tree) == references[f"{start}_snapshot"], f"ENOSPC at write {at}"
        failures += 1
    assert failures > 3
