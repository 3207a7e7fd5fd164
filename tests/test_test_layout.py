"""The test suite's own layout: what a maintainer relies on when adding a test.

No test module imports from another (shared helpers live in conftest.py,
helpers.py and tests/<topic>_helpers.py, so a test file can be moved, split or
deleted without breaking a second one); every marker a test uses is
registered (pytest runs with --strict-markers); and `.ci/run` runs exactly
the README's test command, whose fast subset goes first.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

from tests.conftest import MEMORY_FS, REPO, memory_fs_fits, on_tmpfs

if sys.version_info >= (3, 11):
    import tomllib
else:  # the tomli backport, as patchkit's catalogue loader uses
    import tomli as tomllib

TESTS = REPO / "tests"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "tests." * (node.level > 0) + (node.module or "")
            found.add(base)
            found |= {f"{base}.{alias.name}".replace("..", ".") for alias in node.names}
    return found


def test_no_test_module_imports_from_another():
    test_modules = {f"tests.{p.stem}" for p in TESTS.glob("test_*.py")}
    offenders = {
        path.name: sorted(imported_modules(path) & (test_modules - {f"tests.{path.stem}"}))
        for path in sorted(TESTS.glob("*.py"))
    }
    offenders = {name: mods for name, mods in offenders.items() if mods}
    assert offenders == {}, f"move what they share into tests/helpers.py: {offenders}"


def test_the_layout_check_sees_an_import_from_a_test_module(tmp_path):
    """The check above can fail: each way of writing the import is seen."""
    for line in (
        "from tests.test_merge import lin",
        "import tests.test_merge",
        "from .test_merge import lin",
        "from tests import test_merge",
        "def f():\n    from tests.test_merge import lin",
    ):
        (tmp_path / "test_x.py").write_text(line + "\n")
        assert "tests.test_merge" in imported_modules(tmp_path / "test_x.py"), line


def test_every_marker_used_is_registered():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in config["addopts"]
    registered = {line.split(":")[0].strip() for line in config["markers"]}
    used = set()
    for path in TESTS.glob("test_*.py"):
        used |= set(re.findall(r"pytest\.mark\.(\w+)", path.read_text()))
    builtin = {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings"}
    assert used - builtin <= registered, used - builtin - registered
    assert {"slow", "network", "gpu"} <= registered


def test_ci_runs_exactly_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    [command] = [line for line in readme.splitlines() if "ruff check . &&" in line]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in ci, "README's test command and .ci/run must be the same command"
    assert '-m "not slow and not network"' in command  # the fast subset first


FAULT_WALKS = ("test_signals.py", "test_write_points.py", "test_refresh_transaction.py",
               "test_failures.py")  # fmt: skip


def test_the_fault_walks_copy_their_trees_into_scratch_path():
    """Each walk over every point of a kind (copy, run, check, delete, hundreds of times), and
    the release matrix, works in scratch_path, a tmpfs where there is one, not in tmp_path."""
    walks = {}
    for name in FAULT_WALKS:
        for node in ast.parse((TESTS / name).read_text()).body:
            if isinstance(node, ast.FunctionDef) and "_at_every_" in node.name:
                walks[node.name] = {arg.arg for arg in node.args.args}
    assert len(walks) >= 9, sorted(walks)
    matrix = ast.parse((TESTS / "test_release_matrix.py").read_text()).body
    [release] = [node for node in matrix
                 if isinstance(node, ast.FunctionDef) and node.name == "test_release"]  # fmt: skip
    walks[release.name] = {arg.arg for arg in release.args.args}  # every release's whole tree
    offenders = sorted(name for name, args in walks.items()
                       if "tmp_path" in args or "scratch_path" not in args)  # fmt: skip
    assert offenders == [], offenders


def test_on_tmpfs_reads_the_mount_table():
    mounts = "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n/dev/vda / ext4 rw,relatime 0 0\n"
    assert on_tmpfs(Path("/dev/shm"), mounts)
    assert not on_tmpfs(Path("/"), mounts)
    assert not on_tmpfs(Path("/dev/shm"), "/dev/vda /dev/shm ext4 rw 0 0\n")
    assert not on_tmpfs(Path("/dev/shm"), "")


def test_scratch_path_is_on_the_tmpfs_where_there_is_one(scratch_path, tmp_path):
    if memory_fs_fits(MEMORY_FS):
        assert scratch_path.parent == MEMORY_FS and not any(scratch_path.iterdir())
    else:
        assert scratch_path == tmp_path


def test_a_tmpfs_without_room_for_the_trees_is_not_used(monkeypatch):
    """A container's /dev/shm is 64 MB unless given more: the trees would not fit."""
    monkeypatch.setattr("tests.conftest.on_tmpfs", lambda path: True)
    free = os.statvfs(MEMORY_FS if MEMORY_FS.is_dir() else "/")
    room = free.f_bavail * free.f_frsize
    assert memory_fs_fits(MEMORY_FS, needed=room + 1) is False
    if os.access(MEMORY_FS, os.W_OK):
        assert memory_fs_fits(MEMORY_FS, needed=1) is True
