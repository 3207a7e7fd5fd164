"""state.json and the crash journal are read as hostile input.

patchkit acts only on what it wrote itself: a state or journal entry for a
path outside vllm/, for a file no diff touches, with a backup of its own
choosing, listed twice, of the wrong shape, nested too deeply, or naming a
patch this patchkit does not know is refused in one line naming the file,
with nothing changed; a stale record whose files are back is dropped.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import (
    CATALOGUE,
    applied,
    normalized,
    release_tree,
    run_cli,
    run_subprocess,
    snapshot,
)
from tests.helpers import NESTED, UTILS, one_line, one_line_failure, sha


def edit_state(state_file: Path, edit) -> None:
    data = json.loads(state_file.read_text())
    edit(data)
    state_file.write_text(json.dumps(data))


@pytest.mark.parametrize("path", ["../V/a.txt", "ABSOLUTE", "vllm/../../V/a.txt", "setup.py"])
def test_a_state_file_path_outside_vllm_is_never_acted_on(site, path):
    tree, victim = site
    state_file = applied(tree)
    bad = str(victim / "a.txt") if path == "ABSOLUTE" else path
    record = {"path": bad, "pre_sha256": None, "post_sha256": sha(victim / "a.txt"), "backup": None}
    edit_state(state_file, lambda d: d["patches"][0]["files"].append(record))
    before = snapshot(tree.parent)
    for command in ("revert", "apply", "status"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert str(state_file) in line and "not acted on" in line
    assert snapshot(tree.parent) == before


def test_a_backup_path_of_its_own_choosing_is_refused(site, tmp_path):
    tree, victim = site
    state_file = applied(tree)
    payload = tmp_path / "payload"
    payload.write_text("attacker\n")

    def point_backup_outside(data):
        data["patches"][0]["files"][0]["backup"] = "../../payload"

    edit_state(state_file, point_backup_outside)
    before = snapshot(tree.parent)
    line = one_line_failure(run_cli("revert", "--target", str(tree)))
    assert "is not its own" in line
    assert snapshot(tree.parent) == before


def test_a_journal_path_outside_vllm_is_never_acted_on(site):
    tree, victim = site
    txn = tree / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    entry = {"path": "../V/d.txt", "before": None, "after": sha(victim / "d.txt")}
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(tree.parent)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert "journal" in line and "not acted on" in line
    assert snapshot(tree.parent) == before


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "null",
        '{"format": 1, "vllm_version": null, "patches": [null]}',
        "PATH_NULL",
        "SHA_NUMBER",
        "{not json",
    ],
)
def test_state_of_the_wrong_shape_is_one_line(slim_tree_0260, content):
    state_file = applied(slim_tree_0260)
    data = json.loads(state_file.read_text())
    if content == "PATH_NULL":
        data["patches"][0]["files"][0]["path"] = None
        content = json.dumps(data)
    elif content == "SHA_NUMBER":
        data["patches"][0]["files"][0]["post_sha256"] = 12
        content = json.dumps(data)
    state_file.write_text(content)
    before = snapshot(slim_tree_0260)
    for command in ("status", "apply", "revert", "doctor"):
        result = run_cli(command, "--target", str(slim_tree_0260))
        if command == "doctor":  # doctor reports the tree error and still runs
            assert "Traceback" not in result.output
            continue
        assert str(state_file) in one_line_failure(result)
    assert snapshot(slim_tree_0260) == before


def test_a_forged_state_entry_for_a_file_no_diff_touches_is_refused(slim_tree_0260):
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    init = slim_tree_0260 / "vllm/__init__.py"
    forged = {"path": "vllm/__init__.py", "pre_sha256": None, "post_sha256": sha(init),
              "backup": None}  # fmt: skip
    data["patches"][0]["files"].append(forged)
    state_file.write_text(json.dumps(data))
    before = snapshot(slim_tree_0260)
    for command in ("revert", "apply", "status"):
        line = one_line_failure(run_cli(command, "--target", str(slim_tree_0260)))
        assert "not acted on" in line and "vllm/__init__.py" in line
    assert snapshot(slim_tree_0260) == before and init.is_file()


@pytest.mark.parametrize("names_patches", [False, True])
def test_a_journal_entry_with_before_null_for_a_foreign_file_is_refused(
    slim_tree_0260, names_patches
):
    """``before: null`` means "the run created it": rolling back would delete the file."""
    init = slim_tree_0260 / "vllm/__init__.py"
    txn = slim_tree_0260 / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    entry = {"path": "vllm/__init__.py", "before": None, "after": sha(init)}
    if names_patches:
        entry["patches"] = ["expand-block-n"]  # a real patch, whose diffs never touch it
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(slim_tree_0260)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(slim_tree_0260)))
        assert "journal" in line and "not acted on" in line
    assert snapshot(slim_tree_0260) == before and init.is_file()


def test_a_journal_that_lists_a_file_twice_is_refused(slim_tree_0260):
    """patchkit writes each file once; a second entry could restore half of a rollback."""
    assert (
        run_cli("apply", "--only", "expand-block-n", "--target", str(slim_tree_0260)).exit_code == 0
    )
    utils = slim_tree_0260 / UTILS
    txn = slim_tree_0260 / ".patchkit" / "txn"
    (txn / "orig" / Path(UTILS).parent).mkdir(parents=True)
    (txn / "orig" / UTILS).write_bytes(utils.read_bytes())
    entry = {"path": UTILS, "before": sha(utils), "after": sha(utils),
             "patches": ["expand-block-n"]}  # fmt: skip
    journal = {"state_sha256": "0" * 64, "files": [entry, dict(entry)]}
    (txn / "journal.json").write_text(json.dumps(journal))
    before = snapshot(slim_tree_0260)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(slim_tree_0260)))
        assert "listed twice" in line and "not acted on" in line
    assert snapshot(slim_tree_0260) == before


@pytest.mark.slow
def test_a_state_path_with_a_newline_gives_one_line(slim_tree_0260):
    """A forged path may hold a newline; the error still fits one line (written escaped)."""
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    data["patches"][0]["files"][0]["path"] = "vllm/lora\nINJECTED: all good"
    state_file.write_text(json.dumps(data))
    before = snapshot(slim_tree_0260)
    for command in ("status", "revert", "apply"):
        result = run_subprocess(command, "--target", str(slim_tree_0260))
        line = one_line(result)
        assert "vllm/lora\\nINJECTED" in line, line
    assert snapshot(slim_tree_0260) == before


@pytest.mark.parametrize("where", ["state", "journal"])
def test_deeply_nested_json_is_one_line(slim_tree_0260, where):
    directory = slim_tree_0260 / ".patchkit" / ("txn" if where == "journal" else "")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ("journal.json" if where == "journal" else "state.json")).write_text(NESTED)
    before = snapshot(slim_tree_0260)
    for command in ("apply", "revert"):
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260)))
        assert "nested too deeply" in line and "not acted on" in line
    assert snapshot(slim_tree_0260) == before


def test_an_unknown_patch_in_the_state_is_reported_not_acted_on(slim_tree_0260):
    assert (
        run_cli("apply", "--target", str(slim_tree_0260), "--only", "expand-block-n").exit_code == 0
    )
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    ghost = json.loads(json.dumps(data["patches"][0]))
    ghost["id"] = "ghost"
    ghost["files"][0]["backup"] = f"backups/ghost/{UTILS}"
    data["patches"].append(ghost)  # claims utils.py, which still holds what it "wrote"
    state_file.write_text(json.dumps(data))
    status = run_cli("status", "--target", str(slim_tree_0260))
    assert "'ghost', which this patchkit does not know" in status.stderr
    before = snapshot(slim_tree_0260)
    line = one_line_failure(run_cli("revert", "--target", str(slim_tree_0260)))
    assert "'ghost'" in line and "nothing was changed" in line
    assert snapshot(slim_tree_0260) == before


def test_a_refused_run_leaves_an_interrupted_run_s_leftovers_as_they_were(slim_tree_0260, tmp_path):
    """The real 0.26.0 tree (slim) with expand-block-n applied, then what a run killed
    before its journal leaves in .patchkit/ (a temporary file, a backup no entry records)
    beside an entry for a patch this patchkit does not know: revert, apply and refresh
    refuse, and .patchkit/ is byte for byte as it was. A run that writes sweeps them."""
    tree = slim_tree_0260
    assert run_cli("apply", "--target", str(tree), "--only", "expand-block-n").exit_code == 0
    state_file = tree / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    ghost = json.loads(json.dumps(data["patches"][0]))
    ghost["id"], ghost["files"][0]["backup"] = "ghost", f"backups/ghost/{UTILS}"
    data["patches"].append(ghost)
    state_file.write_text(json.dumps(data))
    leftovers = [tree / ".patchkit/state.json.patchkit-tmp", tree / ".patchkit/backups/x/a.py"]
    for leftover in leftovers:
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_text("left by a killed run\n")
    catalogue = tmp_path / "patches"  # refresh's, copied: it would write there
    shutil.copytree(CATALOGUE.root, catalogue)
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    before = snapshot(tree)
    for args in (("revert",), ("apply",), ("refresh", "expand-block-n")):
        result = run_cli(*args, "--target", str(tree), env=env)
        assert result.exit_code == 1 and "ghost" in one_line_failure(result), args
        assert snapshot(tree) == before, args
    data["patches"].pop()
    state_file.write_text(json.dumps(data))
    assert run_cli("revert", "--target", str(tree)).exit_code == 0
    assert not (tree / ".patchkit").exists()


def test_an_unknown_patch_whose_files_are_back_is_dropped(slim_tree_0260):
    pristine = normalized(slim_tree_0260)
    assert (
        run_cli("apply", "--target", str(slim_tree_0260), "--only", "expand-block-n").exit_code == 0
    )
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    data["patches"][0]["id"] = "ghost"  # a patch a newer patchkit applied, since undone
    data["patches"][0]["files"][0]["backup"] = f"backups/ghost/{UTILS}"
    state_file.write_text(json.dumps(data))
    (slim_tree_0260 / UTILS).write_bytes((release_tree("0.26.0") / UTILS).read_bytes())
    shutil.move(
        slim_tree_0260 / ".patchkit/backups/expand-block-n",
        slim_tree_0260 / ".patchkit/backups/ghost",
    )
    assert run_cli("revert", "--target", str(slim_tree_0260)).exit_code == 0
    assert not (slim_tree_0260 / ".patchkit").exists() and normalized(slim_tree_0260) == pristine


def test_revert_only_never_restores_under_a_patch_this_patchkit_lacks(slim_tree_0260):
    """A newer patchkit's patch stacked on expand-block-n's file."""
    assert (
        run_cli("apply", "--target", str(slim_tree_0260), "--only", "expand-block-n").exit_code == 0
    )
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    lower = data["patches"][0]["files"][0]
    newer = (slim_tree_0260 / UTILS).read_text() + "# future-fix\n"
    (slim_tree_0260 / UTILS).write_text(newer)
    backup = slim_tree_0260 / ".patchkit" / "backups" / "future-fix" / UTILS
    backup.parent.mkdir(parents=True)
    backup.write_bytes((slim_tree_0260 / UTILS).read_bytes()[: -len("# future-fix\n")])
    future = {"id": "future-fix", "patch_sha256": "0" * 64, "variant": "v", "applied_at": "x",
              "files": [{"path": UTILS, "pre_sha256": lower["post_sha256"],
                         "post_sha256": sha(slim_tree_0260 / UTILS),
                         "backup": f"backups/future-fix/{UTILS}"}]}  # fmt: skip
    data["patches"].append(future)
    state_file.write_text(json.dumps(data))
    before = snapshot(slim_tree_0260)
    result = run_cli("revert", "--target", str(slim_tree_0260), "--only", "expand-block-n")
    assert result.exit_code == 1 and "future-fix" in result.stderr
    assert snapshot(slim_tree_0260) == before
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    assert "revert --only" not in json.dumps(status)  # no advice to force a revert here
    assert any(
        "'future-fix', which this patchkit does not know" in w["message"]
        for w in status["warnings"]
    )


# A child whose address space is 1 GiB: a file read whole past that is a MemoryError
# (exit 3), not a machine out of memory.
LIMITED = "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"


@pytest.mark.parametrize("where", ["state", "journal", "state beside a journal"])
def test_a_huge_state_or_journal_is_refused_by_its_size_before_a_byte(slim_tree_0260, where):
    """A 4 GiB (sparse) state.json or journal went whole into memory before its size was
    checked: on a 23 GiB host the kernel killed patchkit (and could have chosen another
    process). The real 0.26.0 tree, applied, then its state file or a journal made huge
    (beside a journal, the roll-back reads the state to know whether the run committed):
    each command that reads it refuses it by its size, in one line."""
    state_file = applied(slim_tree_0260)
    journal = state_file.parent / "txn" / "journal.json"
    journal.parent.mkdir()
    huge = journal if where == "journal" else state_file
    if where == "state beside a journal":
        entry = {"path": UTILS, "before": sha(slim_tree_0260 / UTILS),
                 "after": sha(slim_tree_0260 / UTILS), "patches": ["expand-block-n"]}  # fmt: skip
        journal.write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    with open(huge, "ab") as handle:
        handle.truncate(4 << 30)
    before = snapshot(slim_tree_0260 / "vllm")
    commands = ("status", "apply", "revert") if where == "state" else ("apply", "revert")
    for command in commands:
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260), code=LIMITED))
        assert "larger than 16777216 bytes" in line, line
    assert snapshot(slim_tree_0260 / "vllm") == before and huge.stat().st_size == 4 << 30


def nest(directory: Path, depth: int) -> None:
    """``depth`` directories, one inside the other, made by descriptors (no path that long)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def unnest(directory: Path, depth: int) -> None:
    """Remove what :func:`nest` made, deepest first (shutil.rmtree recurses as deep)."""
    fds = [os.open(directory, os.O_RDONLY | os.O_DIRECTORY)]
    for _ in range(depth - 1):
        fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    for fd in reversed(fds):
        os.rmdir("d", dir_fd=fd)
        os.close(fd)


def test_a_directory_nested_past_the_recursion_limit_in_the_state_is_one_line(slim_tree_0260):
    """1,200 directories one inside the other in .patchkit/backups/ (the real 0.26.0 tree,
    applied, altered so): the walk that looks for links there raised RecursionError,
    exit 3, in every command; now it stops MAX_DEPTH down and names the directory."""
    state_file = applied(slim_tree_0260)
    backups = state_file.parent / "backups"
    nest(backups, 1200)
    try:
        before = snapshot(slim_tree_0260 / "vllm")
        for command in ("status", "apply", "revert"):
            line = one_line(run_subprocess(command, "--target", str(slim_tree_0260)))
            assert "directories deep; patchkit never walks that far" in line, line
        assert snapshot(slim_tree_0260 / "vllm") == before
    finally:
        unnest(backups, 1200)
