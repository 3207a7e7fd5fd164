"""A read-only or full file system: one line and nothing changed, or a no-op.

A tree that needs no write is a no-op even where nothing can be written; one
that needs patching says the file system is read-only (or full) and is left
byte-identical; a failure after the commit (bytecode that cannot be removed)
is a warning, with the patches applied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import (
    WITHOUT_ROOTS_POWERS,
    applied,
    run_cli,
    run_subprocess,
    slim_tree,
    snapshot,
)
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


def _read_only_mount(tmp_path, tree, bind_mount):
    """``tree`` bind-mounted read-only at tmp_path/ro; skips where remounting is refused."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    bind_mount(tree, read_only)
    remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)],
                             capture_output=True)  # fmt: skip
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remount.stderr.decode().strip()}")
    return read_only


def test_a_read_only_pristine_tree_is_a_no_op_for_revert(tmp_path, slim_tree_0260, bind_mount):
    read_only = _read_only_mount(tmp_path, slim_tree_0260, bind_mount)
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


def test_a_dry_run_on_a_read_only_mount_ends_as_the_run_does(tmp_path, slim_tree_0260, bind_mount):
    """apply --dry-run said "4 would apply" and exited 0 where apply refuses: it refuses
    with apply's line and exit code now, and --json with its error document."""
    read_only = _read_only_mount(tmp_path, slim_tree_0260, bind_mount)
    before = snapshot(slim_tree_0260)
    real = run_cli("apply", "--target", str(read_only))
    dry = run_cli("apply", "--dry-run", "--target", str(read_only))
    assert one_line_failure(dry) == one_line_failure(real)
    assert "read-only" in one_line_failure(dry)
    document = json.loads(
        run_cli("apply", "--dry-run", "--json", "--target", str(read_only)).stdout
    )
    assert (document["ok"], document["exit_code"]) == (False, 1)
    assert document["error"]["code"] == "refused-read-only"
    assert snapshot(slim_tree_0260) == before and not (slim_tree_0260 / ".patchkit").exists()


def test_a_dry_run_that_would_write_nothing_on_a_read_only_mount_passes(
    tmp_path, slim_tree_0260, bind_mount
):
    applied(slim_tree_0260)
    read_only = _read_only_mount(tmp_path, slim_tree_0260, bind_mount)
    dry = run_cli("apply", "--dry-run", "--target", str(read_only))
    assert dry.exit_code == 0, dry.output
    assert "nothing needed writing" in dry.output


@pytest.fixture
def foreign_tree(tmp_path):
    """A slim tree another user (uid 65534) owns, its directories not writable by others."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run patchkit without root's powers")
    tree = slim_tree(tmp_path / "t")
    for dirpath, _, names in os.walk(tree):
        for path in [dirpath, *(os.path.join(dirpath, n) for n in names)]:
            os.chown(path, 65534, 65534)
            os.chmod(path, os.stat(path).st_mode & ~0o022)
    return tree


def test_a_dry_run_on_a_tree_this_user_cannot_write_ends_as_the_run_does(foreign_tree):
    """Permission bits, not a read-only mount: as a user who is not the tree's owner (root
    without the powers that pass them), apply --dry-run refuses as apply does, and neither
    makes .patchkit/."""
    before = snapshot(foreign_tree)
    target = ("--target", str(foreign_tree))
    real = run_subprocess("apply", *target, prefix=WITHOUT_ROOTS_POWERS)
    if "setpriv" in real.stderr:
        pytest.skip(f"setpriv cannot drop root's powers here: {real.stderr.strip()}")
    dry = run_subprocess("apply", "--dry-run", *target, prefix=WITHOUT_ROOTS_POWERS)
    assert real.returncode == dry.returncode == 1, dry.stdout
    assert dry.stderr == real.stderr and len(dry.stderr.splitlines()) == 1
    assert "permission denied" in dry.stderr and "owns the vLLM install" in dry.stderr
    assert snapshot(foreign_tree) == before and not (foreign_tree / ".patchkit").exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_dry_run_meets_a_lock_that_is_no_file_as_the_run_does(slim_tree_0260, kind):
    """A copy of the real 0.26.0 tree whose .patchkit/lock is a directory or a FIFO: the
    run refuses it by type before it opens it; the dry run said '4 would apply', exit 0."""
    (slim_tree_0260 / ".patchkit").mkdir()
    lock = slim_tree_0260 / ".patchkit" / "lock"
    lock.mkdir() if kind == "directory" else os.mkfifo(lock)
    before = snapshot(slim_tree_0260 / "vllm")  # snapshot() would block reading the FIFO
    run = run_cli("apply", "--target", str(slim_tree_0260))
    dry = run_cli("apply", "--dry-run", "--target", str(slim_tree_0260))
    assert run.exit_code == dry.exit_code == 1, dry.output
    assert dry.stderr == run.stderr == f"patchkit: error: {lock} is not a regular file; remove it\n"
    assert snapshot(slim_tree_0260 / "vllm") == before
    assert os.listdir(lock.parent) == ["lock"] and lock.is_dir() == (kind == "directory")


def test_a_dry_run_writes_nothing_not_even_the_lock(slim_tree_0260):
    """On a tree patchkit can write, the dry run's check of the lock creates neither
    .patchkit/ nor a lock file that is missing."""
    before = snapshot(slim_tree_0260)
    assert run_cli("apply", "--dry-run", "--target", str(slim_tree_0260)).exit_code == 0
    assert snapshot(slim_tree_0260) == before and not (slim_tree_0260 / ".patchkit").exists()
    applied(slim_tree_0260)
    (slim_tree_0260 / ".patchkit" / "lock").unlink()
    before = snapshot(slim_tree_0260)
    assert run_cli("apply", "--dry-run", "--target", str(slim_tree_0260)).exit_code == 0
    assert snapshot(slim_tree_0260) == before
    assert not (slim_tree_0260 / ".patchkit" / "lock").exists()
