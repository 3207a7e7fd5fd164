"""One rule for waiting on a lock: the tree's and the catalogue's, one reading of the setting.

apply and revert wait for the tree's lock, refresh for the catalogue's too,
each up to PATCHKIT_LOCK_TIMEOUT seconds (60 when unset). The two waits once
read the variable each its own way: `abc` stopped apply with an error and made
refresh wait a silent 60 s. Now patchkit.fs.locks reads it, and a value that
is not a number of seconds is one line, before anything is done, in both.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from patchkit.errors import Refused
from patchkit.fs import locks
from tests.conftest import CATALOGUE, REPO, run_cli, run_subprocess, slim_tree, snapshot


@pytest.mark.parametrize("raw, seconds", [(None, 60.0), ("", 60.0), ("0", 0.0), ("2.5", 2.5),
                                          (" 7 ", 7.0), ("inf", float("inf"))])  # fmt: skip
def test_a_number_of_seconds_is_taken(monkeypatch, raw, seconds):
    if raw is None:
        monkeypatch.delenv(locks.LOCK_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(locks.LOCK_TIMEOUT_ENV, raw)
    assert locks.lock_timeout() == seconds


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "1e", "60s"])
def test_anything_else_is_one_line(monkeypatch, raw):
    from patchkit.cli.words import say

    monkeypatch.setenv(locks.LOCK_TIMEOUT_ENV, raw)
    with pytest.raises(Refused) as refused:
        locks.lock_timeout()
    assert refused.value.reason["value"] == raw
    assert say(refused.value.reason).startswith(f"PATCHKIT_LOCK_TIMEOUT={raw!r} is not a number")


def test_the_setting_is_read_in_one_place_and_flock_taken_in_one():
    """The variable's name as a string, and flock, appear in patchkit.fs.locks alone."""
    found: dict[str, list[str]] = {'"PATCHKIT_LOCK_TIMEOUT"': [], "fcntl.flock(": []}
    for path in sorted((REPO / "patchkit").rglob("*.py")):
        text = path.read_text()
        for needle, where in found.items():
            if needle in text:
                where.append(str(path.relative_to(REPO)))
    assert found == {key: ["patchkit/fs/locks.py"] for key in found}, found


@pytest.fixture
def refresh_ready(tmp_path) -> tuple[Path, Path]:
    """A catalogue copy and a 0.26.0 tree with expand-block-n applied: refresh would run."""
    catalogue = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, catalogue)
    tree = slim_tree(tmp_path / "site")
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    return catalogue, tree


@pytest.mark.parametrize("command", ["apply", "refresh"])
def test_a_bad_setting_is_the_same_error_in_apply_and_refresh(refresh_ready, command):
    """refresh with the catalogue's lock taken by another run: `abc` once meant a silent
    60 s wait there. It is the same one line as in apply, and nothing is written."""
    catalogue, tree = refresh_ready
    args = {"apply": ["apply", "--target", str(tree)],
            "refresh": ["refresh", "expand-block-n", "--target", str(tree)]}[command]  # fmt: skip
    before, tree_before = snapshot(catalogue), snapshot(tree)
    held = os.open(catalogue, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another refresh is writing the catalogue
        env = {"PATCHKIT_PATCHES_DIR": str(catalogue), "PATCHKIT_LOCK_TIMEOUT": "abc"}
        result = run_subprocess(*args, env=env, timeout=30)  # a 60 s wait fails here
    finally:
        os.close(held)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "PATCHKIT_LOCK_TIMEOUT='abc' is not a number of seconds" in line, line
    assert snapshot(catalogue) == before and snapshot(tree) == tree_before


def test_a_taken_catalogue_lock_is_waited_for_as_long_as_the_setting_says(refresh_ready):
    catalogue, tree = refresh_ready
    held = os.open(catalogue, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = {"PATCHKIT_PATCHES_DIR": str(catalogue), "PATCHKIT_LOCK_TIMEOUT": "0"}
        result = run_subprocess("refresh", "expand-block-n", "--target", str(tree), env=env)
    finally:
        os.close(held)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"another patchkit refresh is writing {catalogue} (waited 0 s)" in line, line
