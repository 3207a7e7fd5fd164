"""patchkit never writes, restores or deletes outside the target tree.

A symbolic link in the tree or in `.patchkit/`, a directory swapped for a
link between the check and the write (renameat2), a bind mount inside the
state directory, a `__pycache__` that points elsewhere: patchkit walks the
tree by directory descriptors, refuses what is not its own in one line, and
leaves the directory V beside the tree untouched. A path longer than
PATH_MAX works, since no full path is ever opened.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import applied, release_tree, run_cli, run_subprocess, slim_tree, snapshot
from tests.helpers import UTILS, one_line, one_line_failure, sha


@pytest.mark.parametrize("link", [".patchkit", ".patchkit/backups", ".patchkit/lock"])
def test_a_symlink_in_the_state_directory_is_refused(site, link):
    tree, victim = site
    if link != ".patchkit":
        applied(tree)
    target = victim / "a.txt" if link.endswith("lock") else victim
    if link.endswith("backups"):
        shutil.rmtree(tree / link)
    elif link.endswith("lock"):
        (tree / link).unlink()
    (tree / link).symlink_to(target)
    before = snapshot(tree.parent)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert "symbolic link" in line
    assert snapshot(tree.parent) == before
    assert sorted(p.name for p in victim.iterdir()) == ["a.txt", "d.txt"]


def test_a_target_file_that_is_a_symlink_is_refused_and_kept(site):
    tree, victim = site
    real = victim / "utils.py"
    shutil.move(tree / UTILS, real)
    (tree / UTILS).symlink_to(real)
    before, outside = snapshot(tree), sha(real)
    line = one_line_failure(run_cli("apply", "--target", str(tree)))
    assert "symbolic link" in line and UTILS in line
    assert (tree / UTILS).is_symlink() and sha(real) == outside
    assert snapshot(tree) == before and not (tree / ".patchkit").exists()


def test_a_symlinked_directory_on_the_way_is_refused(site):
    tree, victim = site
    moved = victim / "triton_ops"
    shutil.move(tree / "vllm/lora/ops/triton_ops", moved)
    (tree / "vllm/lora/ops/triton_ops").symlink_to(moved)
    before = snapshot(victim)
    assert "symbolic link" in one_line_failure(run_cli("apply", "--target", str(tree)))
    assert snapshot(victim) == before


def test_a_symlinked_pycache_is_not_followed(site):
    tree, victim = site
    target = tree / "vllm/lora/ops/triton_ops/__pycache__"
    (victim / "utils.cpython-312.pyc").write_bytes(b"not ours")
    target.symlink_to(victim)
    result = run_cli("apply", "--target", str(tree), "--json")
    assert result.exit_code == 0, result.output
    assert (victim / "utils.cpython-312.pyc").read_bytes() == b"not ours"
    assert json.loads(result.stdout)["bytecode_removed"] == []


RENAME_EXCHANGE = 2


SWAP_AT_WRITE = r"""
import ctypes, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
_seen = []
def _hook(event, args):
    if event == "open" and str(args[0]).endswith(".utils.py.patchkit-tmp"):
        _seen.append(1)
        if len(_seen) != 3:
            return
        ops = {ops!r}
        if _libc.renameat2(-100, (ops + "/triton_ops").encode(), -100,
                           (ops + "/swapped").encode(), 2) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
sys.addaudithook(_hook)
"""


def test_a_directory_swapped_for_a_link_mid_write_never_redirects_it(tmp_path, slim_tree_0260):
    victim = tmp_path / "V"
    victim.mkdir()
    (victim / "mine.txt").write_text("precious\n")
    ops = slim_tree_0260 / "vllm/lora/ops"
    (ops / "swapped").symlink_to(victim)  # exchanged with triton_ops (renameat2) mid-write
    before = snapshot(victim)
    hook = SWAP_AT_WRITE.replace("{ops!r}", repr(str(ops)))
    result = run_subprocess("apply", "--target", str(slim_tree_0260), code=hook)
    assert (ops / "triton_ops").is_symlink(), "the swap did not happen"
    assert snapshot(victim) == before, "a write went through the link"
    assert "Traceback" not in result.stderr
    # the write went where the walk had opened: the real directory, now named "swapped"
    assert "block_n" in (ops / "swapped" / "utils.py").read_text()
    assert (ops / "swapped" / "utils.py").read_bytes() != (
        release_tree("0.26.0") / UTILS
    ).read_bytes()


def test_a_component_swapped_back_to_a_directory_mid_walk_is_named_as_a_race(tmp_path):
    """ENOTDIR at the open, a directory at the lstat: a race, not 'a directory, not a directory'."""
    import errno

    from patchkit.fs import safepath

    (tmp_path / "d").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        error = safepath._walk_error(
            OSError(errno.ENOTDIR, "Not a directory"), tmp_path / "d", fd, "d", "apply"
        )
    finally:
        os.close(fd)
    assert isinstance(error, safepath.UnsafePath)
    assert "changed while patchkit walked it" in str(error)
    assert "is a directory, not a directory" not in str(error)


def test_a_bind_mount_in_the_state_directory_is_refused_before_anything(tmp_path, slim_tree_0260,
                                                                        bind_mount):  # fmt: skip
    assert (
        run_cli("apply", "--target", str(slim_tree_0260), "--only", "expand-block-n").exit_code == 0
    )
    user = tmp_path / "u"
    (user / "sub").mkdir(parents=True)
    (user / "a").write_text("x\n")
    (user / "sub" / "b").write_text("y\n")
    inside = slim_tree_0260 / ".patchkit" / "backups" / "expand-block-n" / "vllm" / "extra"
    inside.mkdir()
    bind_mount(user, inside)
    before = snapshot(user)
    for command in ("apply", "revert"):
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260)))
        assert "is a mount point" in line
    assert snapshot(user) == before


def test_an_over_long_path_is_walked_by_descriptors(tmp_path):
    """A tree whose root path is ~4,020 characters: files below it pass PATH_MAX (4,096).

    patchkit opens the root once and reaches every file from that descriptor,
    so the depth of the tree's own path no longer matters: apply
    and revert work there, and revert gives the pristine files back.
    """
    tree = slim_tree(tmp_path / "t")
    parts, length = [], len(str(tmp_path))
    while length < 4000:
        parts.append("d" * min(200, 4000 - length))
        length += len(parts[-1]) + 1
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        for part in parts:  # build the deep directories relative to a descriptor
            os.mkdir(part, dir_fd=fd)
            new_fd = os.open(part, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new_fd
        os.rename(tree, "t", dst_dir_fd=fd)
        deep = Path(tmp_path, *parts, "t")
        applied_deep = run_cli("apply", "--target", str(deep))
        reverted_deep = run_cli("revert", "--target", str(deep))
        os.rename("t", tree, src_dir_fd=fd)
    finally:
        os.close(fd)
    assert applied_deep.exit_code == 0, applied_deep.output
    assert "applied" in applied_deep.stdout
    assert reverted_deep.exit_code == 0, reverted_deep.output
    assert not (tree / ".patchkit").exists()
    assert snapshot(tree) == snapshot(slim_tree(tmp_path / "fresh"))
