"""A read-only or full file system: one line and nothing changed, or a no-op.

A tree that needs no write is a no-op even where nothing can be written; one
that needs patching says the file system is read-only (or full) and is left
byte-identical; a failure after the commit (bytecode that cannot be removed)
is a warning, with the patches applied.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import applied, run_cli, run_subprocess, slim_tree, snapshot
from tests.helpers import failing_lock, one_line_failure


def test_read_only_tree_already_patched_is_a_no_op(slim_tree_0260, monkeypatch):
    applied(slim_tree_0260)
    (slim_tree_0260 / ".patchkit" / "lock").unlink()
    before = snapshot(slim_tree_0260)
    failing_lock(monkeypatch)
    result = run_cli("apply", "--target", str(slim_tree_0260))
    assert result.exit_code == 0, result.output
    assert "nothing needed writing" in result.output
    assert snapshot(slim_tree_0260) == before


def test_read_only_tree_that_needs_patching_names_the_file_system(slim_tree_0260, monkeypatch):
    before = snapshot(slim_tree_0260)
    failing_lock(monkeypatch)
    line = one_line_failure(run_cli("apply", "--target", str(slim_tree_0260)))
    assert "read-only" in line and "owns" not in line
    assert snapshot(slim_tree_0260) == before and not (slim_tree_0260 / ".patchkit").exists()
    result = run_cli("revert", "--target", str(slim_tree_0260))  # nothing applied: no-op
    assert result.exit_code == 0, result.output


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs mount with room for a slim tree plus ~50 KB; skipped where mounting is refused."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_gives_one_line_and_changes_nothing(small_tmpfs):
    tree = slim_tree(small_tmpfs / "t")
    filler = small_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as handle:  # fill the disk, then free ~50 KB
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - 50_000))
    before = snapshot(tree)
    line = one_line_failure(run_cli("apply", "--target", str(tree)))
    assert "no space left" in line and "nothing changed" in line
    assert snapshot(tree) == before and not (tree / ".patchkit").exists()


def test_a_really_read_only_file_system(small_tmpfs):
    """On a tmpfs remounted read-only: a patched tree is a no-op, a pristine one says read-only."""
    patched = slim_tree(small_tmpfs / "patched")
    pristine = slim_tree(small_tmpfs / "pristine")
    applied(patched)
    remount = ["mount", "-o", "remount,ro", str(small_tmpfs)]
    assert subprocess.run(remount, capture_output=True).returncode == 0
    before = snapshot(small_tmpfs)
    result = run_cli("apply", "--target", str(patched))
    assert result.exit_code == 0, result.output
    assert "nothing needed writing" in result.output
    line = one_line_failure(run_cli("apply", "--target", str(pristine)))
    assert "read-only" in line and "owns" not in line
    assert snapshot(small_tmpfs) == before


def test_a_read_only_pristine_tree_is_a_no_op_for_revert(tmp_path, slim_tree_0260, bind_mount):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    bind_mount(slim_tree_0260, read_only)
    remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)],
                             capture_output=True)  # fmt: skip
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remount.stderr.decode().strip()}")
    result = run_subprocess("revert", "--target", str(read_only))
    assert result.returncode == 0, result.stderr
    assert "nothing needed writing" in result.stdout


def test_bytecode_that_cannot_be_removed_is_a_warning_after_the_commit(slim_tree_0260, monkeypatch):
    pycache = slim_tree_0260 / "vllm/lora/ops/triton_ops/__pycache__"
    pycache.mkdir()
    (pycache / "utils.cpython-312.pyc").write_bytes(b"stale")
    real_unlink = os.unlink

    def refusing(path, *args, **kwargs):
        if str(path).endswith(".pyc"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refusing)
    result = run_cli("apply", "--target", str(slim_tree_0260), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert {p["action"] for p in data["patches"]} >= {"applied"}
    assert any(
        "utils.cpython-312.pyc could not be removed" in w["message"] for w in data["warnings"]
    )
    [left] = [w for w in data["warnings"] if w["code"] == "bytecode-left"]
    assert left["path"].endswith("utils.cpython-312.pyc") and left["why"]
